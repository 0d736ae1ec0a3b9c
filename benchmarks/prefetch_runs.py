"""Prefetch benchmark: decode step time with layer-sharded weights, local vs synchronous vs prefetched.

On two gloo ranks (dp = 2), the same model and batch: (a) local weights, no communication; (b)
layer-sharded, k = 0 (synchronous); (c) layer-sharded, k = 1, 2, ..., into the prefetch ring
(:mod:`functional_npu.parallel.prefetch`), in the order the graph's data edges give inductor; (d) k = 1
with inductor's own comm passes on (``raise_comms``, the memory-preserving passes), which must leave the
ring's order alone (each graph's order is hazard-checked, :mod:`functional_npu.checks`). Every configuration is
compiled and warm before any is timed, then all are timed in interleaved rounds. The exposed
communication is ``(T - T_local) / T_comm_alone``, where ``T_comm_alone`` is the same broadcasts
issued back to back with nothing else running. Resident series memory comes from tensor storage:
the owned layers plus the ring (``k + 1`` slots of one layer, the whole of the prefetch memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from functional_npu.checks import check, from_inductor_code
from functional_npu.core import broadcast
from functional_npu.models import forward
from functional_npu.parallel import Plan, coalesced, drain, layer_bytes, layer_shard, resident_bytes
from functional_npu.runtime import LocalWorld, RankContext, watch_parent
from functional_npu.runtime.loading import load_checkpoint
from functional_npu.runtime.serving import CompiledModel, compile_model

from .flags import count
from .shaped_link import rate_for, set_rate
from .timing import rounds

__all__ = ["prefetch_rank", "run_prefetch_bench", "prefetch_table", "prefetch_plot", "main"]

SCHEDULES = {  # inductor's own comm scheduling instead of the sink_waits pass compile_model asks for
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
    """The same model compiled with inductor's own comm scheduling passes on."""
    options = {"reorder_for_compute_comm_overlap": bool(passes), "reorder_for_compute_comm_overlap_passes": passes}
    fwd = torch.compile(
        functools.partial(forward, attention="sdpa", ring=model.ring), fullgraph=True, dynamic=False, options=options
    )
    return dataclasses.replace(model, forward=fwd)


def _stepper(model: CompiledModel, batch: int) -> tuple[Callable[[int], float], str, list[torch.Tensor]]:
    """Warm ``model``'s decode graph; returns (seconds per step over ``n`` steps, its code, its carried state)."""
    from torch._inductor.utils import run_and_get_code

    state = model.new_state(batch)
    tok, pos = torch.arange(batch) + 3, torch.full((batch,), 5)
    with torch.no_grad():
        _, code = run_and_get_code(model.decode, tok, pos, state)

    def per_step(n: int) -> float:
        # the broadcasts the last timed step handed over in flight finish first, so they are not charged to
        # whichever configuration runs next on the same process group
        for t in state.prefetched:
            funcol.wait_tensor(t)
        t0 = time.perf_counter()
        for _ in range(n):
            model.decode(tok, pos, state)
        return (time.perf_counter() - t0) / n

    return per_step, code[0] if code else "", state.prefetched


def _comm_alone(params: dict, mesh: Any, n: int) -> float:
    """Seconds for one step's broadcasts (one per layer and coalesced group, as the forward issues them)
    issued back to back, then waited; the mean over ``n`` steps."""
    axis = params.placement.plan.layer_shard.axis
    size = mesh.axis_size(axis)
    series = params["series"]
    bufs = [
        (torch.empty(sum(math.prod(series[leaf].shape[1:]) for leaf in group), dtype=series[group[0]].dtype), li % size)
        for li in range(len(params["layers"]))
        for group in coalesced(params)
    ]
    t0 = time.perf_counter()
    for _ in range(n):
        out = [broadcast(b, mesh, axis, src=src) for b, src in bufs]
        for t in out:
            funcol.wait_tensor(t)
    return (time.perf_counter() - t0) / n


def _match_link(local: Callable[[int], float], steps: int, per_layer_bytes: int, layer_share: float) -> int:
    """Set the emulated link's rate to one layer's bytes over one layer's compute (the local-weights step
    times the layer's share of it, the slower rank's); every rank calls this together. Returns the rate."""
    dist.barrier()  # both ranks done compiling: a compiler on the other core would slow this one's steps
    local(steps)  # untimed, as in the rounds: the first steps after compiling run slow
    step = torch.tensor([statistics.median(local(steps) for _ in range(3))], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    rate = rate_for(per_layer_bytes, step.item() * layer_share)
    if dist.get_rank() == 0:
        set_rate(rate)
    dist.barrier()
    return rate


def prefetch_rank(
    ctx: RankContext,
    model_dir: str,
    series: str,
    ks: list[int],
    batch: int,
    steps: int,
    repeat: int,
    stock: bool = True,
    match_link: bool = False,
) -> dict[str, Any]:
    """Run on each of 2 ranks: step times (median and spread of interleaved rounds), exposed fractions and
    resident memory per configuration (the prefetch ring at each of ``ks``, and with ``stock``
    inductor's own scheduling choices at k = 1). With ``match_link`` (inside a namespace made by
    :func:`benchmarks.shaped_link.shaped_command`) the ranks first time the local-weights step,
    and set the link's rate so that one layer's broadcast takes one layer's compute on the slower rank."""
    mesh = ctx.mesh({"dp": ctx.world_size, "tp": 1})
    cache_len = 64
    torch._dynamo.reset()
    full = load_checkpoint(model_dir, mesh)
    local = compile_model(full, mesh, batch_sizes=[batch], max_seq_len=cache_len)
    steppers, codes, states, carried_of = {}, {}, [], {}
    steppers["local"], _, _ = _stepper(local, batch)
    params = load_checkpoint(model_dir, mesh, Plan(layer_shard=layer_shard(series, "dp")))
    per_layer = layer_bytes(params)
    owned = resident_bytes(params["series"])
    configs = [(f"k{k}", k, "prefetch") for k in ks] + [(n, 1, sch) for n, sch in STOCK.items() if stock]
    for name, k, schedule in configs:  # every graph compiled and warm before any timing
        plan = dataclasses.replace(params.placement.plan, prefetch_step=k)
        model = compile_model(params, mesh, plan=plan, batch_sizes=[batch], max_seq_len=cache_len)
        if schedule != "prefetch":
            model = _stock(model, SCHEDULES[schedule])
        steppers[name], codes[name], carried = _stepper(model, batch)
        states.append(carried)
        carried_of[name] = list(carried)
    layers = len(params["layers"])
    # one layer's share of the step: its weights' share of all the weights read per token (the
    # embedding row is one row; the lm_head is read whole)
    layer_w = sum(t.numel() for t in full["layers"][0].values())
    total_w = (
        layers * layer_w + full["norm"].numel() + (full["lm_head"] if "lm_head" in full else full["embed"]).numel()
    )
    rate = _match_link(steppers["local"], steps, per_layer, layer_w / total_w) if match_link else None
    steppers["comm_alone"] = functools.partial(_comm_alone, params, mesh)
    # per-step seconds of every configuration in interleaved rounds, after one untimed round (the first call
    # after other graphs compiled may be slow)
    times = rounds({name: functools.partial(per_step, steps) for name, per_step in steppers.items()}, repeat, warmup=1)
    for carried in states:
        drain(carried)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    t_local, t_comm = med["local"], med["comm_alone"]
    runs: dict[str, dict[str, Any]] = {}
    for name, k, schedule in configs:
        groups = len(coalesced(params))
        live = len(carried_of[name]) // groups if groups else 0  # the ring's slots: all the prefetch memory there is
        hazards = check(from_inductor_code(codes[name], k, groups), k, live * groups) if codes[name] else []
        if hazards and schedule == "prefetch":  # the library's own order must pass; a stock order is reported
            raise RuntimeError(f"{name}: inductor's order breaks the prefetch ring: {hazards[0]}")
        runs[name] = {
            "k": k,
            "schedule": schedule,
            "step_s": med[name],
            "step_s_min": min(times[name]),
            "step_s_max": max(times[name]),
            "live_buffers": live,
            "hazards": hazards,
            "resident_bytes": owned + live * per_layer,
            "peak_bytes": owned + live * per_layer,
            "exposed": (med[name] - t_local) / t_comm,
        }
    return {
        "layer_share": layer_w / total_w,
        "local_step_s": t_local,
        "local_step_s_spread": [min(times["local"]), max(times["local"])],
        "comm_alone_s": t_comm,
        "comm_alone_s_spread": [min(times["comm_alone"]), max(times["comm_alone"])],
        "per_layer_compute_s": t_local * layer_w / total_w,
        "per_layer_comm_s": t_comm / layers,
        "replicated_bytes": layers * per_layer,
        "per_layer_bytes": per_layer,
        "layers": layers,
        "owned_bytes": owned,
        "rounds": repeat,
        "steps_per_round": steps,
        "rate_bits": rate,
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
    stock: bool = True,
    match_link: bool = False,
) -> dict[str, Any]:
    """Both ranks' measurements on 2 local gloo ranks (one thread each), merged: the slower rank's medians
    (and spreads); every configuration is compiled first, then timed in ``repeat`` interleaved rounds of
    ``steps`` decode steps."""
    with LocalWorld(2, threads=1, timeout=1800) as world:
        ranks = world.run(prefetch_rank, model_dir, series, list(ks), batch, steps, repeat, stock, match_link)
    out = dict(ranks[0])
    out["local_step_s"] = max(r["local_step_s"] for r in ranks)
    out["comm_alone_s"] = max(r["comm_alone_s"] for r in ranks)
    out["per_layer_compute_s"] = out["local_step_s"] * out["layer_share"]
    out["per_layer_comm_s"] = out["comm_alone_s"] / out["layers"]
    out["runs"] = {}
    for name in ranks[0]["runs"]:
        merged = dict(ranks[0]["runs"][name])
        for key in ("step_s", "step_s_min", "step_s_max"):
            merged[key] = max(r["runs"][name][key] for r in ranks)
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
            "inductor_k1": "k = 1, inductor's default scheduling",
            "raise_comms_k1": "k = 1, inductor raise_comms",
            "memory_preserving_k1": "k = 1, inductor memory-preserving passes",
        }.get(name, f"k = {r['k']}, prefetch ring")
        if r.get("hazards"):
            label += f" ({len(r['hazards'])} hazards: {sorted({h.split(':')[0] for h in r['hazards']})[0]})"
        spread = f" ({r['step_s_min'] * 1e3:.2f}-{r['step_s_max'] * 1e3:.2f})" if "step_s_min" in r else ""
        rows.append(
            f"| {label} | {r['live_buffers']} | {r['step_s'] * 1e3:.2f}{spread} | {r['exposed']:.0%} | "
            f"{r['resident_bytes'] / 2**20:.1f} MiB | {r['peak_bytes'] / 2**20:.1f} MiB ({r['peak_bytes'] / rep:.0%}) |"
        )
    head = [
        "| decode step | ring slots | ms / step, median (min-max) | "
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
    """Step time, exposed fraction and peak series memory against k, for the prefetch ring and
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
        ax[0].plot(ks, [x["step_s"] * 1e3 for x in runs.values()], "o" + style, label=f"prefetch ring, {label}")
        ax[0].axhline(r["local_step_s"] * 1e3, color="gray", ls=style, lw=0.8, label=f"local weights, {label}")
        ax[1].plot(ks, [x["exposed"] for x in runs.values()], "o" + style, label=f"prefetch ring, {label}")
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
    """``python -m benchmarks.prefetch_runs MODEL_DIR OUT_JSON [--ks 0,1,2] ...``: one run, as JSON (how the
    emulated-link benchmark runs it inside its network namespace). Given ``--parent PID``, it ends when that
    process does, and its ranks with it."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefetch_runs")
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--series", default="o_proj")
    parser.add_argument("--ks", default="0,1,2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=count, default=16)
    parser.add_argument("--repeat", type=count, default=3)
    parser.add_argument("--no-stock", action="store_true", help="only the prefetch ring, not inductor's own")
    parser.add_argument(
        "--match-link", action="store_true", help="set the emulated link's rate from the measured compute first"
    )
    parser.add_argument("--parent", type=int, default=None, help="end when this process (the caller) is gone")
    args = parser.parse_args(argv)
    if args.parent is not None:
        threading.Thread(target=watch_parent, args=(args.parent,), daemon=True, name="parent-watchdog").start()
    ks = tuple(int(k) for k in args.ks.split(","))
    res = run_prefetch_bench(
        args.model_dir,
        series=args.series,
        ks=ks,
        batch=args.batch,
        steps=args.steps,
        repeat=args.repeat,
        stock=not args.no_stock,
        match_link=args.match_link,
    )
    Path(args.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
