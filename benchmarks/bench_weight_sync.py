"""Train-to-inference weight sync in buckets of bounded memory, on 2 and 4 gloo ranks, against one broadcast.

    python -m benchmarks weight_sync [--quick] [--layers 28] [--rounds 5] [--worlds 2,4] [--buckets 2,8,32]
                                     [--json FILE [--append]]

A Qwen3-style model (benchmarks/configs.py's FULL: hidden 512, 8 heads, 4 KV heads, vocab 32000; 28 layers, about
121M params; bf16 weights) starts on every rank under one of two training plans over the data-parallel axis
``dp`` and is moved to the inference plan ``Plan(tp="dp")`` (tensor parallel over the same ranks):

- ``layer_sharded``: ``Plan(layer_shard="layer")``, every layer's weights whole on one rank (ZeRO-3-like), moved
  with ``reshard_params``;
- ``fsdp2``: every leaf cut along dim 0 over ``dp`` (what FSDP2 holds), moved with ``reshard``.

Each is synced unbucketed (one ``all_to_all_single``) and in buckets of 2, 8 and 32 MiB (each at least the least
bucket that works, what one dim-0 row of the costliest leaf takes on a rank, rounded up to a MiB; a leaf bigger than
the bucket moves in slabs of its rows, a stacked leaf in slabs of layers); the baseline broadcasts every leaf of the
whole model from rank 0 (``torch.distributed.broadcast``, into fresh tensors). Timed in interleaved rounds from a
barrier to a barrier (the slowest rank counts): median and spread. GB/s per rank is the bytes rank 0 receives over the
median time. Apart from the timed runs, one run of each is measured: bytes received counted at the collectives
(``benchmarks.counting.ReceivedBytes``) against the lower bound, and the peak bytes held beside the result
(``benchmarks.memory.LiveBytes``) against the bound, one bucket plus the largest leaf. Loopback gloo on this
machine's cores, not a device link; with more ranks than cores the ranks are oversubscribed (the output says so).
``--append`` adds this run to the runs already in ``--json FILE``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from functional_npu import Plan, plan_reshard, replicated, reshard, reshard_params, shard, sharded
from functional_npu.core import flatten_with_paths, least_bucket
from functional_npu.models.llama import init_params, param_specs
from functional_npu.parallel import series_specs, stack_series
from functional_npu.placement import place
from functional_npu.runtime import LocalWorld
from functional_npu.runtime.training import plan_params_reshard

from .configs import FULL, QUICK
from .counting import ReceivedBytes
from .flags import count
from .memory import LiveBytes
from .peers import _between_barriers
from .timing import rounds, stats

MIB = 1 << 20
ALL_TO_ALL = "_c10d_functional.all_to_all_single"


def _costs(plan) -> tuple[int, int]:
    """(least bucket size, largest leaf on any rank) of a plan: bytes one dim-0 row of the costliest leaf takes on a
    rank, and the most bytes one leaf holds on a rank, source or destination."""
    moves = {leaf.path: [t.move() for t in plan.transfers if t.path == leaf.path] for leaf in plan.leaves}
    least = least_bucket({leaf.path: leaf.full_shape[0] if leaf.full_shape else None for leaf in plan.leaves}, moves)[2]
    size = lambda leaf: torch.empty((), dtype=leaf.dtype).element_size()  # noqa: E731
    largest = max(math.prod(s) * size(leaf) for leaf in plan.leaves for s in (*leaf.src_shapes, *leaf.dst_shapes))
    return least, largest


def _sources(cfg, mesh, dtype) -> dict[str, dict[str, Any]]:
    """Each training plan's params on this rank, and how to sync them to the inference plan with a bucket size."""
    n = mesh.axis_size("dp")
    full = init_params(cfg, seed=0, dtype=dtype)
    target = place(cfg, mesh, Plan(tp="dp"))
    layered = place(cfg, mesh, Plan(layer_shard="layer"))
    series = layered.plan.layer_shard
    specs = series_specs(param_specs(cfg, layered.plan), series, cfg.num_layers)
    train = shard(stack_series(full, series), specs, mesh, placement=layered)
    leaves = {p: x for p, x in flatten_with_paths(full) if isinstance(x, torch.Tensor)}
    fsdp = {p: sharded(0, "dp") if x.shape[0] % n == 0 else replicated() for p, x in leaves.items()}
    dst = {p: target.layouts[p] for p in leaves}
    fsdp_local = shard(leaves, fsdp, mesh)
    shapes = {p: (tuple(x.shape), x.dtype) for p, x in leaves.items()}

    def fsdp_plan(b):
        return plan_reshard(shapes, fsdp, dst, mesh, bucket_bytes=b)

    return {
        "layer_sharded": {
            "plan": lambda b: plan_params_reshard(train, Plan(tp="dp"), mesh, bucket_bytes=b),
            "run": lambda p: reshard_params(train, Plan(tp="dp"), mesh, exchange=p),
        },
        "fsdp2": {"plan": fsdp_plan, "run": lambda p: reshard(fsdp_local, fsdp, dst, mesh, plan=p)},
        "_full": leaves,
    }


def _measured(run, plan) -> dict[str, int]:
    """One untimed run: bytes received counted at the all_to_all_single calls, how many, the peak held beside the
    result."""
    with ReceivedBytes() as counted, LiveBytes() as mem:
        out = run(plan)
    kept = [x for _, x in flatten_with_paths(out) if isinstance(x, torch.Tensor)]
    return {"counted": counted.by_op[ALL_TO_ALL], "calls": counted.calls[ALL_TO_ALL], "peak": mem.peak_beside(kept)}


def _broadcast(full: dict[str, torch.Tensor], rank: int) -> None:
    for x in full.values():
        dist.broadcast(x if rank == 0 else torch.empty_like(x), 0)


PUBLISHED = "benchmarks/results/weight_sync.json"


def output_path(json_arg: str | None, quick: bool) -> Path | None:
    """Where a run's results go: ``--json FILE`` if named, else the published results for a full run, and nowhere
    for a ``--quick`` one (its smaller model must not replace the published figures)."""
    if json_arg:
        return Path(json_arg)
    return None if quick else Path(PUBLISHED)


def _rank(ctx, layers: int, quick: bool, repeat: int, sizes: tuple[int, ...]) -> dict:
    torch.set_num_threads(1)
    cfg = dataclasses.replace(QUICK if quick else FULL, num_layers=layers)
    mesh = ctx.mesh({"dp": ctx.world_size, "tp": 1})
    sources = _sources(cfg, mesh, torch.bfloat16)
    full = sources.pop("_full")
    systems, out = {}, {"params": sum(x.numel() for x in full.values()), "sources": {}}
    for name, src in sources.items():
        whole = src["plan"](None)
        least, largest = _costs(whole)
        least = -(-least // MIB) * MIB
        t = whole.traffic[mesh.rank]
        rec = {"received": t.received, "lower_bound": t.lower_bound, "largest_leaf": largest, "variants": {}}
        for k in (None, *sizes):
            plan = whole if k is None else src["plan"](max(least, k * MIB))
            key = "unbucketed" if k is None else f"bucket_{k}mib"
            run = src["run"]
            run(plan)  # warm-up: groups, allocator
            rec["variants"][key] = {"bucket_bytes": plan.bucket_bytes, "buckets": len(plan.buckets)}
            rec["variants"][key] |= _measured(run, plan)
            systems[f"{name}/{key}"] = lambda run=run, plan=plan: _between_barriers(lambda: run(plan))
        out["sources"][name] = rec
    _broadcast(full, mesh.rank)
    systems["broadcast"] = lambda: _between_barriers(lambda: _broadcast(full, mesh.rank))
    out["times"] = rounds(systems, repeat)
    out["broadcast_bytes"] = sum(x.numel() * x.element_size() for x in full.values())
    return out


def _row(name: str, v: dict, received: int, lower: int, largest: int, times: list[float]) -> str:
    s = stats(times)
    bound = "-" if v["bucket_bytes"] is None else f"{(v['bucket_bytes'] + largest) / MIB:.1f}"
    bucket = "-" if v["bucket_bytes"] is None else f"{v['bucket_bytes'] / MIB:.0f}"
    return (
        f"| {name} | {bucket} | {v['buckets']} | {s['median'] * 1e3:.0f} ({s['min'] * 1e3:.0f}-{s['max'] * 1e3:.0f}) | "
        f"{received / s['median'] / 1e9:.2f} | {v['counted'] / MIB:.2f} / {lower / MIB:.2f} | "
        f"{v['peak'] / MIB:.1f} | {bound} |"
    )


def _report(n: int, r0: dict, repeat: int) -> list[str]:
    cores = len(os.sched_getaffinity(0))
    note = f" ({n} ranks on {cores} cores: oversubscribed)" if n > cores else ""
    lines = [
        f"\n### {n} gloo ranks{note}: median ms (min-max) of {repeat} interleaved rounds, rank 0's figures\n",
        "| sync | bucket MiB | buckets | ms | GB/s per rank | received / lower bound MiB (counted) | "
        "peak extra MiB | bound MiB (bucket + largest leaf) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rec in r0["sources"].items():
        for key, v in rec["variants"].items():
            times = r0["times"][f"{name}/{key}"]
            lines.append(_row(f"{name} {key}", v, rec["received"], rec["lower_bound"], rec["largest_leaf"], times))
    b = stats(r0["times"]["broadcast"])
    lines.append(
        f"| broadcast from rank 0 (every leaf) | - | - | {b['median'] * 1e3:.0f} ({b['min'] * 1e3:.0f}-"
        f"{b['max'] * 1e3:.0f}) | {r0['broadcast_bytes'] / b['median'] / 1e9:.2f} (rank 1) | "
        f"{r0['broadcast_bytes'] / MIB:.0f} to each other rank | - | - |"
    )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks weight_sync",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=28, help="decoder layers (28: about 121M params)")
    parser.add_argument("--rounds", type=count, default=5, help="interleaved timed rounds")
    parser.add_argument("--worlds", default="2,4", help="gloo world sizes, comma-separated")
    parser.add_argument("--quick", action="store_true", help="QUICK config (vocab 8000), 4 layers, 3 rounds")
    parser.add_argument("--buckets", default="2,8,32", help="bucket sizes in MiB, comma-separated")
    parser.add_argument(
        "--json", metavar="FILE", help=f"where to write the runs (default {PUBLISHED}; with --quick, nowhere)"
    )
    parser.add_argument("--append", action="store_true", help="add this run to the runs in --json FILE")
    args = parser.parse_args(argv)
    sizes = tuple(int(b) for b in args.buckets.split(","))
    layers, repeat = (4, 3) if args.quick else (args.layers, args.rounds)
    cmd = "python -m benchmarks weight_sync " + " ".join(argv if argv is not None else sys.argv[2:])
    results = {"command": cmd.strip(), "layers": layers, "dtype": "bfloat16", "rounds": repeat, "worlds": {}}
    for n in (int(w) for w in args.worlds.split(",")):
        with LocalWorld(n, threads=1, timeout=1200) as world:
            r0 = world.run(_rank, layers, args.quick, repeat, sizes, timeout=1200)[0]
        results["params"] = r0["params"]
        results["worlds"][str(n)] = r0
        if n == 2 or len(results["worlds"]) == 1:
            print(f"model: Qwen3-style, {layers} layers, {r0['params'] / 1e6:.1f}M params, bf16 ({cmd.strip()})")
        print("\n".join(_report(n, r0, repeat)))
    results["cores"] = len(os.sched_getaffinity(0))
    path = output_path(args.json, args.quick)
    if path is None:
        print("\n--quick: nothing written (the published results are full runs; name --json FILE to keep it)")
        return 0
    earlier = json.loads(path.read_text())["runs"] if args.append and path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": [*earlier, results]}, indent=1) + "\n")
    print(f"\nwrote {path}")
