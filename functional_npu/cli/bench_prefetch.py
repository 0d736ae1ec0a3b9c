"""Prefetch benchmark: decode step time with layer-sharded weights, local vs synchronous vs prefetched.

On two gloo ranks (dp = 2), the same model and batch: (a) local weights, no communication; (b)
layer-sharded, k = 0 (synchronous); (c) layer-sharded, k = 1, 2 under
:class:`functional_npu.schedule.PrefetchSchedule`; (d) k = 1 under inductor's stock scheduling, and
under its ``raise_comms`` pass. The exposed communication is ``(T - T_local) / T_comm_alone``, where
``T_comm_alone`` is the same broadcasts issued back to back with nothing else running. Resident
series memory comes from tensor storage (owned layers + carried state) plus the live prefetch
buffers read from the compiled code.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from ..core.collectives import broadcast
from ..models import forward
from ..parallel.layer_shard import layer_shard, resident_bytes
from ..parallel.prefetch import coalesced, drain
from ..runtime.checkpoint import load_checkpoint
from ..runtime.compile import CompiledModel, compile_model
from ..runtime.launch import RankContext
from .timeline import prefetch_timeline

__all__ = ["prefetch_rank", "run_prefetch_bench", "prefetch_table", "prefetch_plot", "main"]

SCHEDULES = {  # inductor's own comm scheduling, for comparison with the prefetch pass
    "inductor": [],
    "raise_comms": ["raise_comms"],
    # torch 2.13's recommended memory-aware passes (see torch._inductor.config)
    "memory_preserving": [
        "reorder_communication_preserving_peak_memory",
        "sink_waits_iterative",
        "reorder_communication_preserving_peak_memory",
    ],
}
STOCK = {"inductor_k1": "inductor", "raise_comms_k1": "raise_comms", "memory_preserving_k1": "memory_preserving"}


def _stock(model: CompiledModel, passes: list[str]) -> CompiledModel:
    """The same model compiled with inductor's own comm scheduling instead of the prefetch pass."""
    options = {"reorder_for_compute_comm_overlap": bool(passes), "reorder_for_compute_comm_overlap_passes": passes}
    fwd = torch.compile(functools.partial(forward, attention="sdpa"), fullgraph=True, dynamic=False, options=options)
    return dataclasses.replace(model, forward=fwd)


def _step_time(model: CompiledModel, batch: int, steps: int, repeat: int) -> tuple[float, str]:
    """Best per-step decode time, and the generated code of the decode graph."""
    from torch._inductor.utils import run_and_get_code

    state = model.new_state(batch)
    tok, pos = torch.arange(batch) + 3, torch.full((batch,), 5)
    with torch.no_grad():
        _, code = run_and_get_code(model.decode, tok, pos, state)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(steps):
            model.decode(tok, pos, state)
        best = min(best, (time.perf_counter() - t0) / steps)
    drain(state.prefetched)
    return best, code[0] if code else ""


def _comm_alone(params: dict, mesh: Any, repeat: int) -> float:
    """Seconds for one step's broadcasts (one per layer and coalesced group, as the forward issues them)
    issued back to back, then waited."""
    axis = params["layer_shard"].axis
    n = mesh.axis_size(axis)
    series = params["series"]
    bufs = [
        (torch.empty(sum(math.prod(series[leaf].shape[1:]) for leaf in group), dtype=series[group[0]].dtype), li % n)
        for li in range(len(params["layers"]))
        for group in coalesced(params)
    ]
    best = float("inf")
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        out = [broadcast(b, mesh, axis, src=src) for b, src in bufs]
        for t in out:
            funcol.wait_tensor(t)
        best = min(best, time.perf_counter() - t0)
    return best


def prefetch_rank(
    ctx: RankContext, model_dir: str, series: str, ks: list[int], batch: int, steps: int, repeat: int
) -> dict[str, Any]:
    """Run on each of 2 ranks: step times, exposed fractions and resident memory per configuration."""
    mesh = ctx.mesh({"dp": ctx.world_size, "tp": 1})
    cache_len = 64
    local = compile_model(load_checkpoint(model_dir, mesh), mesh, batch_sizes=[batch], max_seq_len=cache_len)
    t_local, _ = _step_time(local, batch, steps, repeat)
    params = load_checkpoint(model_dir, mesh, layer_shard=layer_shard(series, "dp"))
    per_layer = sum(x[0].numel() * x.element_size() for x in params["series"].values() if len(x))
    owned = resident_bytes(params["series"])
    runs: dict[str, dict[str, float]] = {}
    for name, k, schedule in [(f"k{k}", k, "prefetch") for k in ks] + [(n, 1, sch) for n, sch in STOCK.items()]:
        torch._dynamo.reset()
        model = compile_model(params, mesh, batch_sizes=[batch], max_seq_len=cache_len, prefetch_step=k)
        if schedule != "prefetch":
            model = _stock(model, SCHEDULES[schedule])
        t, code = _step_time(model, batch, steps, repeat)
        live = prefetch_timeline(code)["live_max"] if code else 0
        runs[name] = {
            "k": k,
            "step_s": t,
            "live_buffers": live,
            "resident_bytes": owned + k * per_layer,
            "peak_bytes": owned + live * per_layer,
        }
    t_comm = _comm_alone(params, mesh, repeat)
    for r in runs.values():
        r["exposed"] = (r["step_s"] - t_local) / t_comm
    layers = len(params["layers"])
    return {
        "local_step_s": t_local,
        "comm_alone_s": t_comm,
        "per_layer_compute_s": t_local / layers,
        "per_layer_comm_s": t_comm / layers,
        "replicated_bytes": layers * per_layer,
        "per_layer_bytes": per_layer,
        "layers": layers,
        "owned_bytes": owned,
        "runs": runs,
    }


def run_prefetch_bench(
    model_dir: str,
    *,
    series: str = "o_proj",
    ks: tuple[int, ...] = (0, 1, 2),
    batch: int = 1,
    steps: int = 16,
    repeat: int = 3,
) -> dict[str, Any]:
    """Both ranks' measurements on 2 local gloo ranks (one thread each), merged: slowest rank's times."""
    from ..runtime.launch import LocalWorld

    with LocalWorld(2, threads=1, timeout=1800) as world:
        ranks = world.run(prefetch_rank, model_dir, series, list(ks), batch, steps, repeat)
    out = dict(ranks[0])
    out["local_step_s"] = max(r["local_step_s"] for r in ranks)
    out["comm_alone_s"] = max(r["comm_alone_s"] for r in ranks)
    out["runs"] = {}
    for name in ranks[0]["runs"]:
        merged = dict(ranks[0]["runs"][name])
        merged["step_s"] = max(r["runs"][name]["step_s"] for r in ranks)
        merged["resident_bytes"] = max(r["runs"][name]["resident_bytes"] for r in ranks)
        merged["peak_bytes"] = max(r["runs"][name]["peak_bytes"] for r in ranks)
        merged["exposed"] = (merged["step_s"] - out["local_step_s"]) / out["comm_alone_s"]
        out["runs"][name] = merged
    out |= {"series": series, "batch": batch}
    return out


def prefetch_table(res: dict[str, Any]) -> str:
    """A markdown table of :func:`run_prefetch_bench`'s result."""
    rep = res["replicated_bytes"]
    rows = [
        f"| local weights (no communication) | - | "
        f"{res['local_step_s'] * 1e3:.2f} | - | - | {rep / 2**20:.1f} MiB (100%) |"
    ]
    for name, r in res["runs"].items():
        label = {
            "inductor_k1": "k = 1, inductor's stock scheduling",
            "raise_comms_k1": "k = 1, inductor raise_comms",
            "memory_preserving_k1": "k = 1, inductor memory-preserving passes",
        }.get(name, f"k = {r['k']}, prefetch schedule")
        rows.append(
            f"| {label} | {r['live_buffers']} | {r['step_s'] * 1e3:.2f} | {r['exposed']:.0%} | "
            f"{r['resident_bytes'] / 2**20:.1f} MiB | {r['peak_bytes'] / 2**20:.1f} MiB ({r['peak_bytes'] / rep:.0%}) |"
        )
    head = [
        "| decode step | live prefetch buffers | ms / step | "
        "exposed comm | resident between steps | peak series bytes |",
        "|---|---|---|---|---|---|",
    ]
    tail = (
        f"\nseries {res['series']!r}, batch {res['batch']}: per layer, compute "
        f"{res['per_layer_compute_s'] * 1e3:.2f} ms vs broadcast alone {res['per_layer_comm_s'] * 1e3:.2f} ms; "
        f"all broadcasts alone {res['comm_alone_s'] * 1e3:.2f} ms per step"
    )
    return "\n".join(head + rows) + tail


def prefetch_plot(res: dict[str, Any], path: str, emulated: dict[str, Any] | None = None) -> bool:
    """Step time, exposed fraction and peak series memory against k, for the prefetch schedule and
    inductor's own scheduling choices, on the plain loopback and (if given) the emulated link (PNG);
    False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    links = [("loopback", res)] + ([("emulated link", emulated)] if emulated else [])
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    for (label, r), style in zip(links, ("-", "--")):
        runs = {n: x for n, x in r["runs"].items() if n.startswith("k")}
        ks = [x["k"] for x in runs.values()]
        ax[0].plot(ks, [x["step_s"] * 1e3 for x in runs.values()], "o" + style, label=f"prefetch schedule, {label}")
        ax[0].axhline(r["local_step_s"] * 1e3, color="gray", ls=style, lw=0.8, label=f"local weights, {label}")
        ax[1].plot(ks, [x["exposed"] for x in runs.values()], "o" + style, label=f"prefetch schedule, {label}")
        for (name, stock), color in zip(STOCK.items(), ("tab:red", "tab:purple", "tab:green")):
            if name in r["runs"]:
                ax[1].plot([1], [r["runs"][name]["exposed"]], "x", color=color, label=f"k=1 {stock}, {label}")
        ax[2].plot(ks, [x["peak_bytes"] / 2**20 for x in runs.values()], "o" + style, label=f"peak, {label}")
    ax[2].axhline(res["replicated_bytes"] / 2**20, color="gray", ls="--", label="replicated")
    ax[0].set(xlabel="prefetch step k", ylabel="ms per decode step")
    ax[1].set(xlabel="prefetch step k", ylabel="exposed communication (fraction)")
    ax[2].set(xlabel="prefetch step k", ylabel="series MiB per rank")
    for a in ax:
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m functional_npu.cli.bench_prefetch MODEL_DIR OUT_JSON [--ks 0,1,2] ...``: one run, as JSON
    (how the emulated-link benchmark runs it inside its network namespace)."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m functional_npu.cli.bench_prefetch")
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--series", default="o_proj")
    parser.add_argument("--ks", default="0,1,2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    ks = tuple(int(k) for k in args.ks.split(","))
    res = run_prefetch_bench(
        args.model_dir, series=args.series, ks=ks, batch=args.batch, steps=args.steps, repeat=args.repeat
    )
    Path(args.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
