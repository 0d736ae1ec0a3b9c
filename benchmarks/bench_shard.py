"""Throughput of ``shard`` (single process) and ``gather`` (2 gloo ranks) against a same-run memcpy.

    python -m benchmarks shard [--mb 64]

Prints a markdown table: GB/s of each transform over the bytes it writes, and its share of
``torch.Tensor.copy_`` bandwidth measured on the same bytes in the same run.
"""

from __future__ import annotations

import argparse

import torch

from functional_npu import Block, Mesh, fused, gather, shard, sharded
from functional_npu.runtime import LocalWorld

from .timing import best_time


def _tree(mb: int) -> tuple[dict, dict]:
    rows = 1024
    cols = mb * 2**20 // 4 // rows // 4
    tree = {
        "qkv": torch.randn(rows, cols),
        "gate_up": torch.randn(rows, cols),
        "o": torch.randn(cols, rows),
        "down": torch.randn(cols, rows),
    }
    specs = {
        "qkv": fused(0, [Block("q", 512, 64), Block("k", 256, 64, True), Block("v", 256, 64, True)], "tp"),
        "gate_up": fused(0, [("gate", 512), ("up", 512)], "tp"),
        "o": sharded(1, "tp"),
        "down": sharded(1, "tp"),
    }
    return tree, specs


def _gather_rank(ctx, mb: int) -> tuple[float, float, int]:
    mesh = ctx.mesh({"tp": 2})
    tree, specs = _tree(mb)
    local = shard(tree, specs, mesh)
    nbytes = sum(t.numel() * t.element_size() for t in tree.values())
    gather(local, specs, mesh)  # creates groups, warms up
    dst = {k: torch.empty_like(v) for k, v in tree.items()}
    t_gather = best_time(lambda: gather(local, specs, mesh))
    t_copy = best_time(lambda: [dst[k].copy_(v) for k, v in tree.items()])
    return t_gather, t_copy, nbytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks shard", description=__doc__)
    parser.add_argument("--mb", type=int, default=64, help="full tree size in MiB (fp32)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    tree, specs = _tree(args.mb)
    mesh = Mesh.abstract({"tp": 2})
    full_bytes = sum(t.numel() * t.element_size() for t in tree.values())
    local_bytes = full_bytes // 2
    t_shard = best_time(lambda: shard(tree, specs, mesh, coordinate=1))
    half = {k: v[: v.shape[0] // 2] for k, v in tree.items()}
    dst = {k: torch.empty_like(v) for k, v in half.items()}
    t_copy_half = best_time(lambda: [dst[k].copy_(v) for k, v in half.items()])
    with LocalWorld(2) as world:
        t_gather, t_copy, nbytes = world.run(_gather_rank, args.mb)[0]
    print(f"tree: {full_bytes / 2**20:.0f} MiB fp32 (GQA-fused qkv, [gate|up], two row-parallel), tp=2\n")
    print("| transform | bytes written | time | GB/s | memcpy GB/s (same bytes, same run) | share of memcpy |")
    print("|---|---|---|---|---|---|")
    for name, t, b, tc in [
        ("shard (1 rank's slice)", t_shard, local_bytes, t_copy_half),
        ("gather over 2 gloo ranks", t_gather, nbytes, t_copy),
    ]:
        print(
            f"| {name} | {b / 2**20:.0f} MiB | {t * 1e3:.1f} ms | "
            f"{b / t / 1e9:.2f} | {b / tc / 1e9:.2f} | {tc / t:.0%} |"
        )
