"""A placement map from expert load: redundant copies for the hot experts, copies spread over ranks.

Per layer, greedily: every expert gets one slot; each spare slot goes to the expert with the
highest load per copy (at most one copy per rank); then the copies, heaviest first, go to the
rank with the least load so far that has a free slot and does not hold that expert yet (if every
such rank holds it, one expert is shifted from a full rank to make room: no rank ever holds an
expert twice). Given the
previous placement, copies that can stay where they are stay (up to the new copy count of their
expert), so a rebalance moves only the added copies. The result is a plain placement
``[layers, ranks, slots]`` for :mod:`functional_npu.eplb`.
"""

from __future__ import annotations

import torch

from .eplb_map import validate_placement

__all__ = ["balanced_placement"]


def _copies(load: list[float], ranks: int, spare: int) -> list[int]:
    copies = [1] * len(load)
    for _ in range(spare):
        open_ = [e for e in range(len(load)) if copies[e] < ranks]
        best = max(open_, key=lambda e: (load[e] / copies[e], -e))
        copies[best] += 1
    return copies


def _assign(
    load: list[float], copies: list[int], ranks: int, slots: int, previous: list[list[int]] | None
) -> list[list[int]]:
    held: list[list[int]] = [[] for _ in range(ranks)]
    weight = [0.0] * ranks
    left = list(copies)
    for r, row in enumerate(previous or []):  # keep what can stay, one copy per rank
        for e in dict.fromkeys(row):
            if left[e] > 0:
                held[r].append(e)
                weight[r] += load[e] / copies[e]
                left[e] -= 1
    replicas = sorted(
        [(load[e] / copies[e], e) for e in range(len(load)) for _ in range(left[e])], key=lambda w: (-w[0], w[1])
    )
    for w, e in replicas:
        free = [r for r in range(ranks) if len(held[r]) < slots and e not in held[r]]
        if not free:
            free = [_make_room(held, weight, load, copies, e, slots)]
        r = min(free, key=lambda r: (weight[r], r))
        held[r].append(e)
        weight[r] += w
    return [sorted(row) for row in held]


def _make_room(
    held: list[list[int]], weight: list[float], load: list[float], copies: list[int], e: int, slots: int
) -> int:
    """Every rank with a free slot holds ``e``: move some ``x`` from a full rank without ``e`` to a free rank
    without ``x`` (one exists: the full rank holds ``slots`` distinct experts, the free one fewer) and
    return the full rank, which now has room for ``e``."""
    full = min([r for r in range(len(held)) if e not in held[r]], key=lambda r: (weight[r], r))
    to = min([r for r in range(len(held)) if len(held[r]) < slots], key=lambda r: (weight[r], r))
    x = next(x for x in reversed(held[full]) if x not in held[to])
    held[full].remove(x)
    held[to].append(x)
    weight[full] -= load[x] / copies[x]
    weight[to] += load[x] / copies[x]
    return full


def balanced_placement(
    load: torch.Tensor, num_ranks: int, slots_per_rank: int, *, previous: torch.Tensor | None = None
) -> torch.Tensor:
    """A placement ``[layers, ranks, slots]`` balancing ``load`` ``[layers, E]`` with redundant copies.

    Args:
        load: non-negative tokens (or any load measure) per layer and logical expert.
        num_ranks: the size of the expert axis.
        slots_per_rank: physical slots per rank; ``ranks * slots - E`` of them hold redundant copies.
        previous: the placement in use ``[layers, ranks, slots]``; copies stay where they are when
            their expert keeps at least that many, so ``plan_rebalance(previous, result)`` moves only
            the copies added to an expert.

    Returns:
        An int64 placement, validated; feed it to ``routing_table`` and ``plan_rebalance``.

    Raises:
        ValueError naming the sizes and a fix.

    Example:
        >>> balanced_placement(torch.tensor([[8.0, 1.0, 1.0]]), 2, 2).tolist()   # the hot expert 0 twice
        [[[0, 1], [0, 2]]]
    """
    if not isinstance(load, torch.Tensor) or load.ndim != 2:
        raise ValueError(
            f"balanced_placement: load must be a tensor [layers, experts], "
            f"got {getattr(load, 'shape', type(load).__name__)}"
        )
    if not bool(torch.isfinite(load).all()) or bool((load < 0).any()):
        raise ValueError("balanced_placement: load must be finite and non-negative (tokens per expert)")
    layers, experts = load.shape
    if num_ranks < 1 or slots_per_rank < 1 or num_ranks * slots_per_rank < experts:
        raise ValueError(
            f"balanced_placement: {num_ranks} ranks x {slots_per_rank} slots = {num_ranks * slots_per_rank} "
            f"slots cannot hold {experts} experts; use at least {-(-experts // max(num_ranks, 1))} slots per rank"
        )
    if slots_per_rank > experts:
        raise ValueError(
            f"balanced_placement: {slots_per_rank} slots per rank exceed the {experts} "
            f"experts (a rank would hold one expert twice); use at most {experts}"
        )
    prev = None
    if previous is not None:
        prev = validate_placement(previous, experts, num_ranks=num_ranks, what="previous placement")
        if tuple(prev.shape) != (layers, num_ranks, slots_per_rank):
            raise ValueError(
                f"balanced_placement: previous placement has shape {tuple(prev.shape)} but the new one is "
                f"{(layers, num_ranks, slots_per_rank)} [layers, ranks, slots]; keep the layers and slots per rank"
            )
        prev = prev.tolist()
    spare = num_ranks * slots_per_rank - experts
    out = []
    for li, row in enumerate(load.double().tolist()):
        out.append(
            _assign(row, _copies(row, num_ranks, spare), num_ranks, slots_per_rank, None if prev is None else prev[li])
        )
    return validate_placement(out, experts, num_ranks=num_ranks)
