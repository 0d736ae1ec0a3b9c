"""Buckets of a reshard: whole leaves grouped, in leaf order, so that no rank's buffers for one bucket pass a bound.

A planned exchange (:mod:`.reshard`) moves every byte in one ``all_to_all_single``: the send and receive buffers
of a rank hold everything it moves at once. With ``bucket_bytes`` the leaves are cut into consecutive groups, each
exchanged and unpacked before the next one's buffers are made, so a rank never holds more than one bucket's
buffers. A bucket's cost on a rank is what its buffers take: the bytes it sends plus the bytes it receives, each
peer's section padded to 8 bytes (as the exchange lays it out). Pure: the same buckets on every rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["Costs", "leaf_costs", "bucket_cost", "group_leaves", "check_bucket_bytes"]

# (rank, "send" | "recv", peer) -> bytes, for the transfers between different ranks
Costs = Counter


def leaf_costs(moves: Iterable[tuple[str, int, int, int]]) -> dict[str, Costs]:
    """Per leaf, the bytes each rank sends to and receives from each peer: ``moves`` are ``(path, src, dst, bytes)``."""
    out: dict[str, Costs] = {}
    for path, src, dst, nbytes in moves:
        c = out.setdefault(path, Counter())
        if src != dst:
            c[(src, "send", dst)] += nbytes
            c[(dst, "recv", src)] += nbytes
    return out


def _padded(n: int, align: int) -> int:
    return -(-n // align) * align


def bucket_cost(costs: Costs, align: int = 8) -> dict[int, int]:
    """Bytes of the send plus receive buffers of each rank that moves something in a bucket of these costs."""
    per_rank: Counter = Counter()
    for (rank, _, _), n in costs.items():
        per_rank[rank] += _padded(n, align)
    return dict(per_rank)


def check_bucket_bytes(bucket_bytes: object, where: str) -> None:
    """Refuse a bucket size that is not a positive int (``None``: one bucket, allowed)."""
    if bucket_bytes is None:
        return
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
        raise TypeError(
            f"{where}: bucket_bytes must be an int (bytes a rank's send plus receive buffers may take for one "
            f"bucket) or None, got {type(bucket_bytes).__name__}"
        )
    if bucket_bytes <= 0:
        raise ValueError(
            f"{where}: bucket_bytes must be positive (bytes a rank's send plus receive buffers may take for one "
            f"bucket), got {bucket_bytes}; pass None for one exchange of every leaf"
        )


def group_leaves(
    paths: Sequence[str], costs: Mapping[str, Costs], bucket_bytes: int | None, *, where: str = "reshard"
) -> tuple[tuple[str, ...], ...]:
    """Consecutive groups of ``paths`` (whole leaves, in order) whose buffers take at most ``bucket_bytes`` on every
    rank; greedy: a leaf joins the current bucket unless that would pass the bound. ``None``: one bucket.

    Raises:
        ValueError if one leaf alone passes the bound (naming it, its bytes, the rank and the least bucket size).
    """
    check_bucket_bytes(bucket_bytes, where)
    if bucket_bytes is None or not paths:
        return (tuple(paths),)
    alone = {p: max(bucket_cost(costs[p]).items(), key=lambda kv: (kv[1], -kv[0]), default=(0, 0)) for p in paths}
    worst = max(paths, key=lambda p: alone[p][1])
    rank, need = alone[worst]
    if need > bucket_bytes:
        raise ValueError(
            f"{where}: bucket_bytes={bucket_bytes} is below what leaf {worst!r} alone takes on rank {rank}: {need} "
            f"bytes (sent plus received, each peer's section padded to 8 bytes); a bucket holds whole leaves, so "
            f"use a bucket of at least {need} bytes"
        )
    buckets: list[tuple[str, ...]] = []
    current: list[str] = []
    held: Costs = Counter()
    for p in paths:
        trial = held + costs[p]
        if current and max(bucket_cost(trial).values(), default=0) > bucket_bytes:
            buckets.append(tuple(current))
            current, trial = [], Counter(costs[p])
        current.append(p)
        held = trial
    buckets.append(tuple(current))
    return tuple(buckets)
