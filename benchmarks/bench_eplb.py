"""Bytes moved by an EPLB rebalance against moving every expert, and its time on gloo.

    python -m benchmarks eplb [--layers 8] [--experts 64] [--redundant 2] [--moved 0.1]

The scenario (seeded): each layer starts from experts split evenly over the ranks plus
``--redundant`` slots per rank holding copies of that layer's hot experts. The new placement
re-places about ``--moved`` of the experts (pairs swapped between ranks) and half of the hot set
changes (new hot experts get the redundant slots; hot experts that stay keep theirs).

A second table re-places with ``balanced_placement`` after a load shift, with and without the
previous placement. Bytes are exact counts from the plan at Qwen3-30B-A3B expert size (hidden 2048, expert FFN 768,
bf16), for 2 and 4 ranks; "every expert" is what re-sending the whole new placement costs (each
rank receives every slot it holds). Time is measured on local gloo ranks at a smaller expert size
(``--hidden``, ``--ffn``) on this machine, best of 3, for the planned moves and for a plan in which
every rank's experts change owner (each rank takes its neighbour's slots).
"""

from __future__ import annotations

import argparse

import torch

from functional_npu.eplb import balanced_placement, plan_rebalance, rebalance
from functional_npu.runtime import LocalWorld

from .timing import best_time


def _assign_hot(
    base: list[list[int]], hot: list[int], slots: int, keep: list[list[int]] | None = None
) -> list[list[int]]:
    """Fill ``slots`` redundant slots per rank with copies of ``hot`` on ranks that do not hold them."""
    extra: list[list[int]] = [[] for _ in base]
    if keep is not None:  # hot experts that stay hot keep their old redundant slot
        for r, old in enumerate(keep):
            extra[r] = [e for e in old if e in hot and e not in base[r]][:slots]
    placed = {e for row in extra for e in row}
    for e in [e for e in hot if e not in placed]:
        free = [r for r in range(len(base)) if len(extra[r]) < slots and e not in base[r] and e not in extra[r]]
        if free:
            extra[min(free, key=lambda r: len(extra[r]))].append(e)
    for r in range(len(base)):  # anything left: copies of the hottest experts the rank lacks
        for e in hot + list(range(sum(map(len, base)))):
            if len(extra[r]) >= slots:
                break
            if e not in base[r] and e not in extra[r]:
                extra[r].append(e)
    return [b + x for b, x in zip(base, extra)]


def scenario(layers: int, experts: int, ranks: int, redundant: int, moved: float, seed: int = 0) -> tuple[list, list]:
    """(old, new) placements [layers][ranks][slots] as described in the module docstring."""
    g = torch.Generator().manual_seed(seed)
    per, n_hot = experts // ranks, ranks * redundant
    old, new = [], []
    for _ in range(layers):
        load = torch.rand(experts, generator=g) ** 4
        hot_old = torch.argsort(load, descending=True)[:n_hot].tolist()
        base = [list(range(r * per, (r + 1) * per)) for r in range(ranks)]
        old_l = _assign_hot(base, hot_old, redundant)
        swapped = [row[:] for row in base]
        for _ in range(max(1, round(moved * experts / 2))):  # swap a pair of experts between two ranks
            a, b = torch.randperm(ranks, generator=g)[:2].tolist()
            i, j = torch.randint(per, (2,), generator=g).tolist()
            swapped[a][i], swapped[b][j] = swapped[b][j], swapped[a][i]
        fresh = [e for e in torch.randperm(experts, generator=g).tolist() if e not in hot_old]
        hot_new = hot_old[: n_hot // 2] + fresh[: n_hot - n_hot // 2]
        new.append(_assign_hot(swapped, hot_new, redundant, keep=[row[per:] for row in old_l]))
        old.append(old_l)
    return old, new


def _rotated(placement: list) -> list:
    """Every rank takes its neighbour's slots: every expert changes owner."""
    return [[layer[(r + 1) % len(layer)] for r in range(len(layer))] for layer in placement]


def _time_rank(ctx, old, new, experts: int, hidden: int, ffn: int) -> dict[str, float]:
    mesh = ctx.mesh({"ep": ctx.world_size})
    r = mesh.axis_index("ep")
    g = torch.Generator().manual_seed(r)
    slots = len(old[0][0])
    params = {
        "layers": [
            {
                "experts_gate_up": torch.randn(slots, 2 * ffn, hidden, generator=g).to(torch.bfloat16),
                "experts_down": torch.randn(slots, hidden, ffn, generator=g).to(torch.bfloat16),
            }
            for _ in old
        ]
    }
    out = {}
    for name, target in (("planned", new), ("every expert", _rotated(old))):
        plan = plan_rebalance(old, target, experts)
        rebalance(params, plan, mesh, "ep")  # warm-up, creates the group
        out[name] = best_time(lambda: rebalance(params, plan, mesh, "ep"), repeat=3)
        out[name + " moves"] = plan.experts_moved()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks eplb", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--redundant", type=int, default=2, help="redundant slots per rank")
    parser.add_argument("--moved", type=float, default=0.1, help="fraction of experts re-placed")
    parser.add_argument("--hidden", type=int, default=512, help="expert hidden size for the timed run")
    parser.add_argument("--ffn", type=int, default=192, help="expert FFN size for the timed run")
    parser.add_argument("--time-ranks", type=int, nargs="*", default=[2], help="rank counts to time on gloo")
    args = parser.parse_args(argv)
    full_expert = 3 * 2048 * 768 * 2  # gate, up, down of Qwen3-30B-A3B in bf16
    print(
        f"{args.layers} MoE layers, {args.experts} experts, {args.redundant} redundant slots per rank, "
        f"~{args.moved:.0%} of experts re-placed, half the hot set changed; "
        f"bytes at {full_expert / 2**20:.1f} MiB per expert\n"
    )
    print(
        "| ranks | slots/rank | experts moved (planned) | bytes moved (planned) | bytes moving every expert | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for ranks in (2, 4):
        old, new = scenario(args.layers, args.experts, ranks, args.redundant, args.moved)
        plan = plan_rebalance(old, new, args.experts)
        slots = len(old[0][0])
        every = args.layers * ranks * slots * full_expert
        print(
            f"| {ranks} | {slots} | {plan.experts_moved()} of {args.layers * ranks * slots} slots | "
            f"{plan.bytes_moved(full_expert) / 2**30:.2f} GiB | {every / 2**30:.2f} GiB | "
            f"{plan.bytes_moved(full_expert) / every:.1%} |"
        )
    print("\nbalanced_placement after a load shift (~10% of experts change load; same layers and slots):\n")
    print(
        "| ranks | slots/rank | moved: with previous= | moved: from scratch | "
        "bytes with previous= | bytes from scratch |"
    )
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    load = torch.rand(args.layers, args.experts, generator=g) ** 6 * 1000
    shifted = load.clone()
    k = max(1, round(args.moved * args.experts))
    shifted[:, :k] = shifted[:, :k].flip(1) * 3
    for ranks in (2, 4):
        slots = args.experts // ranks + args.redundant
        previous = balanced_placement(load, ranks, slots)
        kept = plan_rebalance(previous, balanced_placement(shifted, ranks, slots, previous=previous), args.experts)
        scratch = plan_rebalance(previous, balanced_placement(shifted, ranks, slots), args.experts)
        print(
            f"| {ranks} | {slots} | {kept.experts_moved()} | {scratch.experts_moved()} | "
            f"{kept.bytes_moved(full_expert) / 2**30:.2f} GiB | {scratch.bytes_moved(full_expert) / 2**30:.2f} GiB |"
        )
    small = 3 * args.hidden * args.ffn * 2
    print(
        f"\ntime on local gloo ranks (bf16 experts of {small / 2**20:.2f} MiB; "
        f"best of 3, eager; noisy shared machine):\n"
    )
    print("| ranks | planned: moves | planned: time | every expert: moves | every expert: time |")
    print("|---|---|---|---|---|")
    for ranks in args.time_ranks:
        old, new = scenario(args.layers, args.experts, ranks, args.redundant, args.moved)
        with LocalWorld(ranks, threads=1) as world:
            t = world.run(_time_rank, old, new, args.experts, args.hidden, args.ffn)[0]
        print(
            f"| {ranks} | {t['planned moves']} | {t['planned'] * 1e3:.0f} ms | "
            f"{t['every expert moves']} | {t['every expert'] * 1e3:.0f} ms |"
        )
