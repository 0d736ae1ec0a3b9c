"""Prefetch overlap on an emulated interconnect: the ranks in a private network namespace whose
loopback is rate-limited, so communication takes wire time instead of CPU copies.

On the plain loopback two gloo ranks on two cores copy every byte through TCP on the cores the
compute needs, which says more about the host than about the schedule. Here the prefetch benchmark
(:mod:`functional_npu.cli.bench_prefetch`) runs a second time inside ``unshare --net`` with
``tc qdisc add dev lo root tbf rate R``: ``R`` is chosen so one layer's broadcast takes about one
layer's compute, as measured on the plain loopback in the same run. Needs root (or user namespaces)
and ``tc``; without them the result says why, in one line, and holds the plain-loopback figures only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..parallel.prefetch_cost import Link, choose_k, exposed
from .bench_prefetch import run_prefetch_bench

__all__ = ["link_unavailable", "rate_for", "run_emulated", "run_link_bench", "shaped_command", "model_check"]

_QUEUE = "200ms"  # tbf latency: how long a packet may wait in the queue before it is dropped


def shaped_command(rate_bits: int, argv: list[str]) -> list[str]:
    """``argv`` run in a new network namespace whose loopback is up and limited to ``rate_bits`` per second."""
    if not isinstance(rate_bits, int) or rate_bits < 1_000_000:
        raise ValueError(f"link rate must be an integer of at least 1 Mbit/s (in bit/s), got {rate_bits!r}")
    # the bucket refills while the ranks compute, so a large one lets every broadcast start with a free
    # burst; it must still hold the largest loopback packet (64 KiB with segmentation offload, plus headers)
    burst = 96 * 1024
    setup = (
        f"ip link set lo up && tc qdisc add dev lo root tbf rate {rate_bits}bit burst {burst} latency {_QUEUE}"
        ' && exec "$0" "$@"'
    )
    return ["unshare", "--net", "sh", "-c", setup, *argv]


def link_unavailable() -> str | None:
    """Why the emulated link cannot be made here (one line), or None when it can."""
    missing = [tool for tool in ("unshare", "tc", "ip") if shutil.which(tool) is None]
    if missing:
        return f"emulated link skipped: {', '.join(missing)} not found (install iproute2 / util-linux)"
    try:
        done = subprocess.run(shaped_command(10**9, ["true"]), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"emulated link skipped: {e}"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"emulated link skipped: a private network namespace with tc is not permitted here ({why})"
    return None


def rate_for(layer_bytes: float, layer_compute_s: float) -> int:
    """The rate (bit/s) at which one layer's broadcast takes one layer's compute."""
    if layer_bytes <= 0 or layer_compute_s <= 0:
        raise ValueError(f"rate_for: needs positive bytes and seconds, got {layer_bytes}, {layer_compute_s}")
    return max(1_000_000, int(8 * layer_bytes / layer_compute_s))


def run_emulated(
    model_dir: str,
    rate_bits: int,
    *,
    series: str,
    ks: tuple[int, ...],
    batch: int,
    steps: int,
    repeat: int,
    timeout: float = 1800.0,
) -> dict[str, Any]:
    """The prefetch benchmark in a shaped namespace (a subprocess, killed with its ranks on timeout)."""
    with tempfile.TemporaryDirectory(prefix="functional-npu-link.") as tmp:
        out = Path(tmp) / "prefetch.json"
        argv = [sys.executable, "-m", "functional_npu.cli.bench_prefetch", model_dir, str(out)]
        argv += ["--series", series, "--ks", ",".join(map(str, ks)), "--batch", str(batch)]
        argv += ["--steps", str(steps), "--repeat", str(repeat)]
        proc = subprocess.Popen(
            shaped_command(rate_bits, argv),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the emulated-link benchmark did not finish in {timeout:.0f} s") from None
        finally:  # a timeout or an interrupt: the namespace's ranks go with it
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        if proc.returncode != 0 or not out.is_file():
            tail = "\n".join(log.strip().splitlines()[-10:])
            raise RuntimeError(f"the emulated-link benchmark failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())


def run_link_bench(
    model_dir: str,
    *,
    series: str = "o_proj",
    ks: tuple[int, ...] = (0, 1, 2),
    batch: int = 1,
    steps: int = 16,
    repeat: int = 3,
    rate_bits: int | None = None,
) -> dict[str, Any]:
    """Plain loopback, then (where permitted) the emulated link at ``rate_bits`` (default: one layer's
    broadcast in one layer's compute, from the loopback run): ``{"loopback", "emulated", "rate_bits",
    "skipped"}``."""
    plain = run_prefetch_bench(model_dir, series=series, ks=ks, batch=batch, steps=steps, repeat=repeat)
    out: dict[str, Any] = {"loopback": plain, "emulated": None, "rate_bits": None, "skipped": link_unavailable()}
    if out["skipped"] is None:
        rate = rate_bits or rate_for(plain["per_layer_bytes"], plain["per_layer_compute_s"])
        out["rate_bits"] = rate
        out["emulated"] = run_emulated(model_dir, rate, series=series, ks=ks, batch=batch, steps=steps, repeat=repeat)
    return out


def model_check(res: dict[str, Any]) -> dict[str, Any]:
    """The cost model against one run's own measurements: per prefetch-schedule run, the exposed
    fraction :func:`functional_npu.parallel.prefetch_cost.exposed` predicts from the measured
    per-layer compute and broadcast time, the measured one, and their difference; and the ``k`` that
    ``prefetch_step="auto"`` picks from those two inputs (no budget)."""
    layers, compute, comm = res["layers"], res["per_layer_compute_s"], res["per_layer_comm_s"]
    rows = []
    for r in res["runs"].values():
        if r.get("schedule", "prefetch") != "prefetch":
            continue
        predicted = exposed(layers, r["k"], compute, comm, comm)
        rows.append({"k": r["k"], "predicted": predicted, "measured": r["exposed"], "error": r["exposed"] - predicted})
    link = Link(bytes_per_s=res["per_layer_bytes"] / comm) if comm > 0 else Link(float("inf"))
    auto = choose_k(res["per_layer_bytes"], num_layers=layers, compute_s=compute, link=link)
    return {"rows": rows, "auto_k": auto, "max_abs_error": max((abs(r["error"]) for r in rows), default=0.0)}
