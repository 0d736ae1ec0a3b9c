"""Buckets of a reshard: leaves in leaf order, a leaf too big for a bucket cut along its dim 0 into slabs, so that
no rank's buffers for one bucket pass a bound.

A planned exchange (:mod:`.reshard_plan`) moves every byte in one ``all_to_all_single``: the send and receive buffers
of a rank hold everything it moves at once. With ``bucket_bytes`` the leaves are cut into consecutive groups, each
exchanged and unpacked before the next one's buffers are made, so a rank never holds more than one bucket's
buffers. A bucket's cost on a rank is what its buffers take: the bytes it sends plus the bytes it receives, each
peer's section padded to 8 bytes (as the exchange lays it out).

A *slab* is rows ``[start, stop)`` of a leaf's dim 0 in the full tensor (a stacked leaf's layers); its boxes are the
plan's boxes cut to those rows. A leaf whose buffers fit a bucket alone moves whole (in the next bucket if the
current one is too full); a bigger one is cut into slabs, the first filling what the current bucket has left, each
next one as big as a bucket takes. A leaf is cut no finer than one row (a 0-dim leaf not at all), so the least
bucket that works is what the costliest single row takes. Pure: the same buckets on every rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "Costs",
    "Move",
    "Slab",
    "leaf_costs",
    "slab_costs",
    "bucket_cost",
    "least_bucket",
    "group_slabs",
    "check_bucket_bytes",
]

# (rank, "send" | "recv", peer) -> bytes, for the transfers between different ranks
Costs = Counter
# one box of a leaf: (src rank, dst rank, its first dim-0 row in the full tensor, its rows, its bytes)
Move = tuple[int, int, int, int, int]
# rows [start, stop) of a leaf's dim 0 in the full tensor: (path, start, stop)
Slab = tuple[str, int, int]


def leaf_costs(moves: Iterable[tuple[str, int, int, int]]) -> dict[str, Costs]:
    """Per leaf, the bytes each rank sends to and receives from each peer: ``moves`` are ``(path, src, dst, bytes)``."""
    out: dict[str, Costs] = {}
    for path, src, dst, nbytes in moves:
        c = out.setdefault(path, Counter())
        if src != dst:
            c[(src, "send", dst)] += nbytes
            c[(dst, "recv", src)] += nbytes
    return out


def slab_costs(moves: Iterable[Move], start: int, stop: int) -> Costs:
    """The bytes each rank sends to and receives from each peer for rows ``[start, stop)`` of one leaf."""
    out: Costs = Counter()
    for src, dst, row, rows, nbytes in moves:
        n = min(stop, row + rows) - max(start, row)
        if src != dst and n > 0:
            out[(src, "send", dst)] += nbytes // rows * n
            out[(dst, "recv", src)] += nbytes // rows * n
    return out


def _padded(n: int, align: int) -> int:
    return -(-n // align) * align


def bucket_cost(costs: Costs, align: int = 8) -> dict[int, int]:
    """Bytes of the send plus receive buffers of each rank that moves something in a bucket of these costs."""
    per_rank: Counter = Counter()
    for (rank, _, _), n in costs.items():
        per_rank[rank] += _padded(n, align)
    return dict(per_rank)


def _worst(costs: Costs) -> tuple[int, int]:
    """(rank, bytes) of the rank whose buffers take the most (the lowest such rank), or (0, 0)."""
    return max(bucket_cost(costs).items(), key=lambda kv: (kv[1], -kv[0]), default=(0, 0))


def _fits(costs: Costs, bound: int) -> bool:
    return _worst(costs)[1] <= bound


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


def _costliest_row(moves: Sequence[Move], length: int) -> tuple[int, int]:
    """(rank, bytes) of the costliest single row of a leaf: the cost is constant between the boxes' row edges."""
    edges = {0} | {m[2] for m in moves} | {m[2] + m[3] for m in moves}
    return max((_worst(slab_costs(moves, e, e + 1)) for e in edges if e < length), key=lambda rb: rb[1])


def least_bucket(lengths: Mapping[str, int | None], moves: Mapping[str, Sequence[Move]]) -> tuple[str, int, int]:
    """The least ``bucket_bytes`` that works: ``(leaf, rank, bytes)`` of the costliest slab that cannot be cut, one
    dim-0 row of a leaf (a 0-dim leaf, one row, never moves between ranks: it cannot be sharded)."""
    rows = {p: _costliest_row(moves[p], n or 1) for p, n in lengths.items()}
    worst = max(rows, key=lambda p: rows[p][1])
    return worst, *rows[worst]


def _check_least(lengths: Mapping[str, int | None], moves: Mapping[str, Sequence[Move]], bound: int, where: str):
    worst, rank, need = least_bucket(lengths, moves)
    if need > bound:
        raise ValueError(
            f"{where}: bucket_bytes={bound} is below what one dim-0 row of leaf {worst!r} takes on rank {rank}: "
            f"{need} bytes (sent plus received, each peer's section padded to 8 bytes); a bucket cuts a leaf along "
            f"dim 0 no finer than one row, so use a bucket of at least {need} bytes"
        )


def _slab_stop(moves: Sequence[Move], start: int, length: int, held: Costs, bound: int) -> int:
    """The largest ``stop`` in ``(start, length]`` whose rows ``[start, stop)`` fit beside ``held``, else ``start``
    (the cost only grows with ``stop``: a binary search)."""
    if _fits(held + slab_costs(moves, start, length), bound):
        return length
    lo, hi = start, length - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _fits(held + slab_costs(moves, start, mid), bound) else (lo, mid - 1)
    return lo


def group_slabs(
    lengths: Mapping[str, int | None],
    moves: Mapping[str, Sequence[Move]],
    bucket_bytes: int | None,
    *,
    where: str = "reshard",
) -> tuple[tuple[Slab, ...], ...]:
    """Consecutive buckets of slabs (in leaf order, each leaf's rows in order, every row once) whose buffers take at
    most ``bucket_bytes`` on every rank. ``lengths``: each leaf's dim-0 size (``None`` for a 0-dim leaf, one row);
    ``moves``: each leaf's boxes. A leaf that fits a bucket alone stays whole; ``None``: one bucket of whole leaves.

    Raises:
        ValueError if one row of a leaf alone passes the bound (naming the leaf, both sizes, the rank and the least
        bucket size that works).
    """
    check_bucket_bytes(bucket_bytes, where)
    if bucket_bytes is None or not lengths:
        return (tuple((p, 0, n or 1) for p, n in lengths.items()),)
    _check_least(lengths, moves, bucket_bytes, where)
    buckets: list[tuple[Slab, ...]] = []
    current: list[Slab] = []
    held: Costs = Counter()
    for path, n in lengths.items():
        length, start, ms = n or 1, 0, moves[path]
        alone = _fits(slab_costs(ms, 0, length), bucket_bytes)
        while start < length:
            stop = _slab_stop(ms, start, length, held, bucket_bytes)
            if current and (stop == start or (alone and stop < length)):  # no room: the next bucket
                buckets.append(tuple(current))
                current, held = [], Counter()
                continue
            current.append((path, start, stop))
            held += slab_costs(ms, start, stop)
            start = stop
            if start < length:  # cut: the bucket is full
                buckets.append(tuple(current))
                current, held = [], Counter()
    buckets.append(tuple(current))
    return tuple(buckets)
