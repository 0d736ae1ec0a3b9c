"""Prefetch overlap on an emulated interconnect: the ranks in a private network namespace whose
loopback is rate-limited, so communication takes wire time instead of CPU copies.

On the plain loopback two gloo ranks on two cores copy every byte through TCP on the cores the
compute needs, which says more about the host than about the schedule. Here the prefetch benchmark
(:mod:`benchmarks.prefetch_runs`) runs a second time on a link made by
:mod:`benchmarks.shaped_link`, at a rate ``R`` where one layer's broadcast takes about one
layer's compute: the run compiles and warms every configuration, measures its local-weights step,
sets ``R`` from it, then times. Where the host cannot make the link the result says why, in one
line, and holds the plain-loopback figures only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from functional_npu.parallel import Link, choose_k, exposed

from . import child_env
from .prefetch_runs import run_prefetch_bench
from .shaped_link import link_unavailable, shaped_command

__all__ = ["run_emulated", "run_link_bench", "model_check", "stop_group", "private_tmp_env"]

_START_RATE = 10**10  # until the run has measured its compute and set the matching rate
_STOP_GRACE_S = 10.0  # what a stopped group is given to clean up (a compiler removing its temporaries) before SIGKILL


def stop_group(proc: subprocess.Popen, grace_s: float = _STOP_GRACE_S) -> None:
    """End ``proc``'s process group: SIGTERM, so that each process cleans up (a C compiler removes its ``cc*.s``
    temporaries), then SIGKILL for what is left after ``grace_s`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):  # the leader's children may outlive it
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def private_tmp_env(tmp: str) -> dict[str, str]:
    """The child's environment with ``TMPDIR`` in ``tmp`` (the run's own directory, removed with it whatever
    killed the child), and inductor's cache where it would be without that, so that warm starts are kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    os.makedirs(Path(tmp) / "tmp", exist_ok=True)
    return child_env(TMPDIR=str(Path(tmp) / "tmp"), TORCHINDUCTOR_CACHE_DIR=cache)


def run_emulated(
    model_dir: str,
    rate_bits: int | None = None,
    *,
    series: str,
    ks: tuple[int, ...],
    batch: int,
    steps: int,
    repeat: int,
    stock: bool = True,
    timeout: float = 1800.0,
) -> dict[str, Any]:
    """The prefetch benchmark in a shaped namespace (a subprocess, killed with its ranks on timeout), at
    ``rate_bits``, or by default at the rate where one layer's broadcast takes one layer's compute as the
    run measures it before timing (its result's ``rate_bits``)."""
    with tempfile.TemporaryDirectory(prefix="functional-npu-link.") as tmp:
        out = Path(tmp) / "prefetch.json"
        argv = [sys.executable, "-m", "benchmarks.prefetch_runs", model_dir, str(out)]
        argv += ["--series", series, "--ks", ",".join(map(str, ks)), "--batch", str(batch)]
        argv += ["--steps", str(steps), "--repeat", str(repeat)] + ([] if stock else ["--no-stock"])
        argv += ([] if rate_bits else ["--match-link"]) + ["--parent", str(os.getpid())]
        proc = subprocess.Popen(
            shaped_command(rate_bits or _START_RATE, argv),
            env=private_tmp_env(tmp),
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
            stop_group(proc)
        if proc.returncode != 0 or not out.is_file():
            tail = "\n".join(log.strip().splitlines()[-10:])
            raise RuntimeError(f"the emulated-link benchmark failed (exit {proc.returncode}):\n{tail}")
        res = json.loads(out.read_text())
        return res | {"rate_bits": rate_bits or res["rate_bits"]}


def run_link_bench(
    model_dir: str,
    *,
    series: str = "o_proj",
    ks: tuple[int, ...] = (0, 1, 2),
    batch: int = 1,
    steps: int = 16,
    repeat: int = 3,
    rate_bits: int | None = None,
    stock: bool = True,
) -> dict[str, Any]:
    """Plain loopback, then (where permitted) the emulated link at ``rate_bits`` (default: one layer's
    broadcast in one layer's compute, as that run measures it): ``{"loopback", "emulated", "rate_bits",
    "skipped"}``."""
    plain = run_prefetch_bench(model_dir, series=series, ks=ks, batch=batch, steps=steps, repeat=repeat, stock=stock)
    out: dict[str, Any] = {"loopback": plain, "emulated": None, "rate_bits": None, "skipped": link_unavailable()}
    if out["skipped"] is None:
        out["emulated"] = run_emulated(
            model_dir, rate_bits, series=series, ks=ks, batch=batch, steps=steps, repeat=repeat, stock=stock
        )
        out["rate_bits"] = out["emulated"]["rate_bits"]
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
