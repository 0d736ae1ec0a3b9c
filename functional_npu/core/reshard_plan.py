"""The plan of a reshard: pure data computed from (full shapes, dtypes, source layouts, destination layouts, mesh
shape), the same on every rank; :mod:`.reshard_run` runs it, :func:`.reshard.reshard` is the transform.

For every leaf, the full tensor is cut into *atoms*, boxes on which the set of ranks holding it (source) and the set
of ranks needing it (destination) are constant. A rank takes whatever it already holds from itself and fetches every
other atom from exactly one holder, chosen deterministically: among the holders that differ from it on the fewest
mesh axes, round-robin over atoms (spreading load over replicas). So each rank receives exactly the bytes it needs
and does not hold (the lower bound) and every destination byte is written once; on the wire each peer's section is
padded to 8 bytes, so a rank may receive up to 7 bytes per peer more.

Each rank's part is precomputed (:mod:`.reshard_program`): the boxes it packs into one flat byte buffer per peer
(every dtype moved as raw bytes), those it copies locally and those it unpacks, with their byte offsets. With
``bucket_bytes`` the exchange is cut into buckets (:mod:`.buckets`): leaves in leaf order, a leaf bigger than a
bucket cut along its dim 0 into slabs whose boxes are the atoms' boxes cut to the slab's rows; each bucket has its
own programs, so a rank's send plus receive buffers for one bucket never take more than ``bucket_bytes``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .buckets import Move, Slab, check_bucket_bytes, group_slabs
from .layout import Layout, Piece, check_shape, local_pieces, validate
from .mesh import Mesh
from .reshard_program import LeafPlan, ReshardProgram, Transfer, bucket_programs, programs

__all__ = ["ReshardPlan", "RankTraffic", "plan_reshard"]


@dataclass(frozen=True, slots=True)
class RankTraffic:
    """Bytes one rank moves: ``received == lower_bound`` (what it needs and does not hold) for a minimal plan.

    ``allgather_slice`` is what the same rank receives if every leaf sharded in the source is
    all-gathered whole and then sliced (the one-tensor-at-a-time approach).
    """

    rank: int
    sent: int
    received: int
    local_copy: int
    lower_bound: int
    allgather_slice: int


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """The whole exchange, for every rank: pure data, equal on every rank.

    Attributes:
        mesh_shape: ``((axis, size), ...)`` in mesh order.
        axes: the mesh axes the exchange runs over (those on which some transfer's ends differ), in mesh order.
        leaves: per leaf, in tree order.
        transfers: every box moved, ordered by (src, dst, descending itemsize, leaf order).
        traffic: per rank, bytes sent / received / copied locally, the lower bound and the all-gather figure.
        programs: per rank, its part of the exchange in one bucket (see :class:`ReshardProgram`).
        bucket_bytes: the most bytes a rank's send plus receive buffers take for one bucket (``None``: one bucket).
        buckets: per bucket, per rank, its part of that bucket's exchange.
        slabs: per bucket, its leaves' rows: ``(path, start, stop)`` of the full tensor's dim 0, in leaf order
            (``(path, 0, rows)``: the whole leaf; a 0-dim leaf is one row).
    """

    mesh_shape: tuple[tuple[str, int], ...]
    axes: tuple[str, ...]
    leaves: tuple[LeafPlan, ...]
    transfers: tuple[Transfer, ...]
    traffic: tuple[RankTraffic, ...]
    programs: tuple[ReshardProgram, ...]
    bucket_bytes: int | None = None
    buckets: tuple[tuple[ReshardProgram, ...], ...] = ()
    slabs: tuple[tuple[Slab, ...], ...] = ()

    @property
    def bucket_paths(self) -> tuple[tuple[str, ...], ...]:
        """The leaves of each bucket, in order (a leaf cut into slabs is in each bucket that holds one)."""
        return tuple(tuple(s.path for s in programs[0].steps) for programs in self.buckets)

    def report(self) -> str:
        """A markdown table of bytes per rank against the lower bound and all-gather-then-slice."""
        rows = [
            "| rank | sent | received | lower bound | local copy | all-gather-then-slice |",
            "|---|---|---|---|---|---|",
        ]
        for t in self.traffic:
            rows.append(
                f"| {t.rank} | {t.sent} | {t.received} | {t.lower_bound} | {t.local_copy} | {t.allgather_slice} |"
            )
        return "\n".join(rows)


# ---- planning -------------------------------------------------------------------------------
def _whole(pieces: list[Piece] | None, length: int) -> list[Piece]:
    return [(0, length, 1)] if pieces is None else pieces


def _segments(length: int, per_rank: list[list[Piece]]) -> list[tuple[int, int]]:
    """Cut ``[0, length)`` at every piece boundary (every index of a strided piece): ``[(start, len)]``."""
    cuts = {0, length}
    for pieces in per_rank:
        for start, stop, step in pieces:
            cuts.update(range(start, stop) if step != 1 else (start, stop))
    edges = sorted(c for c in cuts if 0 <= c <= length)
    return [(a, b - a) for a, b in zip(edges, edges[1:])]


def _offset(pieces: list[Piece], pos: int) -> int | None:
    """Where full index ``pos`` sits in the local dim made of ``pieces`` (None if not held)."""
    base = 0
    for start, stop, step in pieces:
        if start <= pos < stop and (pos - start) % step == 0:
            return base + (pos - start) // step
        base += len(range(start, stop, step))
    return None


def _dim_table(length: int, src: list[list[Piece]], dst: list[list[Piece]]):
    """Segments of one dim, and per segment each rank's local offset in source and destination (or None)."""
    segs = _segments(length, src + dst)
    src_off = [[_offset(p, a) for p in src] for a, _ in segs]
    dst_off = [[_offset(p, a) for p in dst] for a, _ in segs]
    return segs, src_off, dst_off


def _coords(mesh: Mesh) -> list[tuple[int, ...]]:
    """Every world rank's coordinate, in mesh axis order."""
    return [tuple(mesh.at(r).coordinate.values()) for r in range(mesh.size)]


def _distance(coords: list[tuple[int, ...]], a: int, b: int) -> int:
    return sum(x != y for x, y in zip(coords[a], coords[b]))


def _leaf_transfers(leaf: LeafPlan, src: Layout, dst: Layout, mesh: Mesh) -> list[Transfer]:
    ranks = range(mesh.size)
    src_p = [local_pieces(leaf.path, src, leaf.full_shape, mesh.at(r)) for r in ranks]
    dst_p = [local_pieces(leaf.path, dst, leaf.full_shape, mesh.at(r)) for r in ranks]
    coords = _coords(mesh)
    tables = []
    for d, length in enumerate(leaf.full_shape):
        s = [_whole(p[d] if d < len(p) else None, length) for p in src_p]
        t = [_whole(p[d] if d < len(p) else None, length) for p in dst_p]
        tables.append(_dim_table(length, s, t))
    item = torch.empty((), dtype=leaf.dtype).element_size()
    out: list[Transfer] = []
    for n_atom, ks in enumerate(itertools.product(*[range(len(segs)) for segs, _, _ in tables])):
        lens = [tables[d][0][k][1] for d, k in enumerate(ks)]
        holders = [r for r in ranks if all(tables[d][1][k][r] is not None for d, k in enumerate(ks))]
        needers = [r for r in ranks if all(tables[d][2][k][r] is not None for d, k in enumerate(ks))]
        for i, r in enumerate(needers):
            if r in holders:
                s = r
            else:
                near = min(_distance(coords, h, r) for h in holders)
                best = [h for h in holders if _distance(coords, h, r) == near]
                s = best[(n_atom + i) % len(best)]
            sbox = tuple((tables[d][1][k][s], n) for d, (k, n) in enumerate(zip(ks, lens)))
            dbox = tuple((tables[d][2][k][r], n) for d, (k, n) in enumerate(zip(ks, lens)))
            row = tables[0][0][ks[0]][0] if ks else 0
            out.append(Transfer(leaf.path, s, r, sbox, dbox, math.prod(lens) * item, row))
    return out


def _traffic(
    mesh: Mesh, leaves: Sequence[LeafPlan], transfers: Sequence[Transfer], src: Mapping[str, Layout]
) -> tuple[RankTraffic, ...]:
    out = []
    for r in range(mesh.size):
        sent = sum(t.nbytes for t in transfers if t.src == r != t.dst)
        received = sum(t.nbytes for t in transfers if t.dst == r != t.src)
        local = sum(t.nbytes for t in transfers if t.src == r == t.dst)
        gathered = 0
        for leaf in leaves:
            if not src[leaf.path].is_replicated:
                item = torch.empty((), dtype=leaf.dtype).element_size()
                gathered += (math.prod(leaf.full_shape) - math.prod(leaf.src_shapes[r])) * item
        needed = sum(
            math.prod(leaf.dst_shapes[r]) * torch.empty((), dtype=leaf.dtype).element_size() for leaf in leaves
        )
        out.append(RankTraffic(r, sent, received, local, needed - local, gathered))
    return tuple(out)


def _local_shapes(path: str, layout: Layout, shape: tuple[int, ...], mesh: Mesh) -> tuple[tuple[int, ...], ...]:
    out = []
    for r in range(mesh.size):
        pieces = local_pieces(path, layout, shape, mesh.at(r))
        out.append(
            tuple(
                n if d >= len(pieces) or pieces[d] is None else sum(len(range(*p)) for p in pieces[d])
                for d, n in enumerate(shape)
            )
        )
    return tuple(out)


def _check_leaves(shapes: Mapping, src_specs: Mapping, dst_specs: Mapping) -> None:
    """One line for leaves :func:`plan_reshard` cannot plan: a path of ``shapes`` with no layout, or an entry that is
    not ``(full shape, dtype)``."""
    for name, specs in (("src_specs", src_specs), ("dst_specs", dst_specs)):
        missing = [p for p in shapes if p not in specs]
        if missing:
            raise ValueError(
                f"plan_reshard: {name} has no layout for {len(missing)} path(s) of shapes, e.g. {missing[0]!r}; give "
                f"one per leaf (leaf_specs(specs, tree))"
            )
    for path, entry in shapes.items():
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], torch.dtype)):
            raise TypeError(
                f"plan_reshard: shapes[{path!r}] must be (full shape, dtype), e.g. (tuple(x.shape), x.dtype), got "
                f"{type(entry).__name__}"
            )
        check_shape(entry[0], f"plan_reshard: shapes[{path!r}]'s shape")


def plan_reshard(
    shapes: Mapping[str, tuple[Sequence[int], torch.dtype]],
    src_specs: Mapping[str, Layout],
    dst_specs: Mapping[str, Layout],
    mesh: Mesh,
    *,
    bucket_bytes: int | None = None,
) -> ReshardPlan:
    """The exchange that takes every rank from ``src_specs`` to ``dst_specs``. Pure; single-process.

    Args:
        shapes: ``{path: (full shape, dtype)}`` of every leaf.
        src_specs, dst_specs: ``{path: Layout}`` for the same paths (see ``leaf_specs``).
        mesh: the mesh (its coordinate is ignored: the plan covers every rank).
        bucket_bytes: the most bytes any rank's send plus receive buffers may take at once: the leaves go in
            buckets in leaf order, exchanged one after another, a leaf too big for a bucket cut along its dim 0 into
            slabs of whole rows (``None``: one bucket).

    Returns:
        A :class:`ReshardPlan`; ``plan.traffic`` holds the bytes per rank and the lower bound,
        ``plan.slabs`` the rows of each bucket's leaves.

    Raises:
        ValueError / TypeError: a layout that does not fit, a ``bucket_bytes`` that is not a positive int or is
        below what one dim-0 row of a leaf takes on some rank (naming the leaf, both sizes and the least bucket).

    Example:
        >>> plan = plan_reshard(
        ...     {"w": ((8, 4), torch.float32)},
        ...     {"w": sharded(0, "tp")},
        ...     {"w": sharded(1, "tp")},
        ...     Mesh.abstract({"tp": 2}),
        ... )
        >>> [t.received for t in plan.traffic]
        [32, 32]
    """
    check_bucket_bytes(bucket_bytes, "reshard")
    _check_leaves(shapes, src_specs, dst_specs)
    leaves, transfers = [], []
    for path, (shape, dtype) in shapes.items():
        shape = tuple(shape)
        validate(path, src_specs[path], shape, dtype, mesh.shape)
        validate(path, dst_specs[path], shape, dtype, mesh.shape)
        leaf = LeafPlan(
            path,
            dtype,
            shape,
            _local_shapes(path, src_specs[path], shape, mesh),
            _local_shapes(path, dst_specs[path], shape, mesh),
        )
        leaves.append(leaf)
        transfers += _leaf_transfers(leaf, src_specs[path], dst_specs[path], mesh)
    order = {leaf.path: i for i, leaf in enumerate(leaves)}
    items = {leaf.path: torch.empty((), dtype=leaf.dtype).element_size() for leaf in leaves}
    transfers.sort(key=lambda t: (t.src, t.dst, -items[t.path], order[t.path]))  # stable: box order kept
    coords = _coords(mesh)
    crossed = {i for t in transfers for i, (a, b) in enumerate(zip(coords[t.src], coords[t.dst])) if a != b}
    axes = tuple(a for i, a in enumerate(mesh.axis_names) if i in crossed)
    traffic = _traffic(mesh, leaves, transfers, src_specs)
    moves: dict[str, list[Move]] = {p: [] for p in order}
    for t in transfers:
        moves[t.path].append(t.move())
    lengths = {leaf.path: leaf.full_shape[0] if leaf.full_shape else None for leaf in leaves}
    slabs = group_slabs(lengths, moves, bucket_bytes)
    whole = programs(mesh, axes, leaves, transfers, src_specs, dst_specs)
    buckets = (
        (whole,)
        if len(slabs) == 1
        else tuple(bucket_programs(b, mesh, axes, leaves, transfers, src_specs, dst_specs) for b in slabs)
    )
    mesh_shape = tuple(mesh.shape.items())
    return ReshardPlan(mesh_shape, axes, tuple(leaves), tuple(transfers), traffic, whole, bucket_bytes, buckets, slabs)
