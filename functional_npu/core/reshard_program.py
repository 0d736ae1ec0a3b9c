"""Each rank's part of a reshard: the boxes that move (:class:`Transfer`, one box of a leaf from one rank to
another), and per rank, per bucket, a :class:`ReshardProgram`: the boxes it packs into one flat byte buffer per peer
(every dtype moved as raw bytes, each peer's section starting on an 8-byte boundary), copies locally and unpacks,
with their byte offsets, so a run only walks its lists. A slab (rows of a leaf's dim 0, :mod:`.buckets`) gets the
boxes cut to its rows and the window of the local source rows they read. Pure data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from .buckets import Move, Slab
from .layout import Layout
from .mesh import Mesh

__all__ = ["Box", "Transfer", "LeafPlan", "LeafSteps", "ReshardProgram", "programs", "bucket_programs"]

Box = tuple[tuple[int, int], ...]  # (start, length) per dim of a local tensor
_ALIGN = 8  # every peer's section of a flat buffer starts on an 8-byte boundary (so byte chunks view back as any dtype)


@dataclass(frozen=True, slots=True)
class Transfer:
    """One box of one leaf moving from world rank ``src`` to world rank ``dst`` (``src == dst``: a local copy);
    ``row``: the full tensor's dim-0 index of the box's first row (0 for a 0-dim leaf)."""

    path: str
    src: int
    dst: int
    src_box: Box
    dst_box: Box
    nbytes: int
    row: int = 0

    def rows(self, start: int, stop: int) -> Transfer | None:
        """This box cut to rows ``[start, stop)`` of the full tensor's dim 0 (``None``: none of them)."""
        if not self.src_box:
            return self
        n = self.src_box[0][1]
        lo, hi = max(start, self.row), min(stop, self.row + n)
        if lo >= hi or hi - lo == n:
            return None if lo >= hi else self
        (s, _), (d, _) = self.src_box[0], self.dst_box[0]
        shift = lo - self.row
        return replace(
            self,
            src_box=((s + shift, hi - lo), *self.src_box[1:]),
            dst_box=((d + shift, hi - lo), *self.dst_box[1:]),
            nbytes=self.nbytes // n * (hi - lo),
            row=lo,
        )

    def move(self) -> Move:
        """``(src, dst, row, rows, bytes)``, as :mod:`.buckets` counts it."""
        return self.src, self.dst, self.row, self.src_box[0][1] if self.src_box else 1, self.nbytes


@dataclass(frozen=True, slots=True)
class LeafPlan:
    """A leaf's full shape and dtype, and its local shape on every rank before and after."""

    path: str
    dtype: torch.dtype
    full_shape: tuple[int, ...]
    src_shapes: tuple[tuple[int, ...], ...]
    dst_shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class LeafSteps:
    """One leaf's (or one slab's) part of a rank's exchange: its destination shape and dtype, the boxes it packs
    (source box, byte offset in the send buffer), copies locally (source box, destination box) and unpacks
    (destination box, byte offset in the receive buffer, bytes).

    For a slab: ``window``, the rows ``(start, count)`` of the local source's dim 0 its send and local boxes read
    (``None``: the whole leaf); ``opens``: its bucket makes the destination leaf (its first slab); ``closes``: its
    bucket completes it (its last slab). A whole leaf opens and closes in one bucket.
    """

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    send: tuple[tuple[Box, int], ...]
    local: tuple[tuple[Box, Box], ...]
    recv: tuple[tuple[Box, int, int], ...]
    window: tuple[int, int] | None = None
    opens: bool = True
    closes: bool = True


@dataclass(frozen=True, slots=True)
class ReshardProgram:
    """What one rank does for a :class:`ReshardPlan` (or one bucket of it), precomputed (so a traced ``reshard``
    only walks its own lists).

    ``group``: its exchange group (world ranks, in group order); ``send[j]`` / ``recv[j]``: the boxes
    for group peer ``j`` in buffer order; ``*_sizes``: padded bytes per peer; ``local``: boxes it copies;
    ``steps``: the same per leaf, in leaf order, with byte offsets; ``pads``: ``(offset, bytes)`` of the send
    buffer's alignment padding.
    """

    group: tuple[int, ...]
    send: tuple[tuple[tuple[str, Box], ...], ...]
    send_sizes: tuple[int, ...]
    recv: tuple[tuple[tuple[str, Box, int], ...], ...]
    recv_sizes: tuple[int, ...]
    local: tuple[tuple[str, Box, Box], ...]
    dst_shapes: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    leaves: tuple[tuple[str, tuple[int, ...], torch.dtype, Layout, Layout], ...]
    steps: tuple[LeafSteps, ...] = ()
    pads: tuple[tuple[int, int], ...] = ()


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _laid_out(per_peer: list[list[Transfer]]) -> tuple[list[tuple[Transfer, int]], list[int], list[tuple[int, int]]]:
    """Each transfer with its byte offset in the flat buffer, each peer's padded size, and the padding's spans."""
    placed, sizes, pads, at = [], [], [], 0
    for ts in per_peer:
        start = at
        for t in ts:
            placed.append((t, at))
            at += t.nbytes
        sizes.append(_padded(at - start))
        if start + sizes[-1] > at:
            pads.append((at, start + sizes[-1] - at))
        at = start + sizes[-1]
    return placed, sizes, pads


def _window(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """The dim-0 rows ``(start, count)`` that ``boxes`` span (``None``: no boxes)."""
    if not boxes:
        return None
    start = min(b[0][0] for b in boxes)
    return start, max(b[0][0] + b[0][1] for b in boxes) - start


def _steps(leaf: LeafPlan, r: int, sent, locals_, got, rows: tuple[int, int] | None) -> LeafSteps:
    """Rank ``r``'s steps for ``leaf``, or for its slab of ``rows`` (``None``: the whole leaf)."""
    send = tuple((t.src_box, at) for t, at in sent if t.path == leaf.path)
    local = tuple((t.src_box, t.dst_box) for t in locals_ if t.path == leaf.path)
    recv = tuple((t.dst_box, at, t.nbytes) for t, at in got if t.path == leaf.path)
    if rows is None:
        return LeafSteps(leaf.path, leaf.dst_shapes[r], leaf.dtype, send, local, recv)
    window = _window([b for b, _ in send] + [b for b, _ in local])
    length = leaf.full_shape[0]
    return LeafSteps(
        leaf.path, leaf.dst_shapes[r], leaf.dtype, send, local, recv, window, rows[0] == 0, rows[1] == length
    )


def _program(
    mesh: Mesh,
    r: int,
    axes: tuple[str, ...],
    leaves: Sequence[LeafPlan],
    transfers: Sequence[Transfer],
    src,
    dst,
    rows: Mapping[str, tuple[int, int]] | None = None,
):
    group = mesh.at(r).group_ranks(axes) if axes else (r,)
    sends = [[t for t in transfers if t.src == r != t.dst == peer] for peer in group]
    recvs = [[t for t in transfers if t.dst == r != t.src == peer] for peer in group]
    locals_ = [t for t in transfers if t.src == r == t.dst]
    sent, send_sizes, pads = _laid_out(sends)
    got, recv_sizes, _ = _laid_out(recvs)
    steps = tuple(_steps(leaf, r, sent, locals_, got, (rows or {}).get(leaf.path)) for leaf in leaves)
    return ReshardProgram(
        group=tuple(group),
        send=tuple(tuple((t.path, t.src_box) for t in ts) for ts in sends),
        send_sizes=tuple(send_sizes),
        recv=tuple(tuple((t.path, t.dst_box, t.nbytes) for t in ts) for ts in recvs),
        recv_sizes=tuple(recv_sizes),
        local=tuple((t.path, t.src_box, t.dst_box) for t in locals_),
        dst_shapes=tuple((leaf.path, leaf.dst_shapes[r], leaf.dtype) for leaf in leaves),
        leaves=tuple((leaf.path, leaf.src_shapes[r], leaf.dtype, src[leaf.path], dst[leaf.path]) for leaf in leaves),
        steps=steps,
        pads=tuple(pads),
    )


def programs(
    mesh: Mesh,
    axes: tuple[str, ...],
    leaves: Sequence[LeafPlan],
    transfers: Sequence[Transfer],
    src: Mapping[str, Layout],
    dst: Mapping[str, Layout],
    rows: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[ReshardProgram, ...]:
    """Every rank's program for ``transfers`` of ``leaves`` (``rows``: the leaves that are slabs, and their rows)."""
    return tuple(_program(mesh, r, axes, leaves, transfers, src, dst, rows) for r in range(mesh.size))


def bucket_programs(slabs: Sequence[Slab], mesh, axes, leaves, transfers, src, dst) -> tuple[ReshardProgram, ...]:
    """Every rank's program for the bucket of ``slabs`` (the plan's axes, so every bucket runs over one group): the
    boxes cut to each slab's rows, in the plan's order; a leaf that is not whole gets its steps' windows."""
    rows = {path: (start, stop) for path, start, stop in slabs}
    mine = [leaf for leaf in leaves if leaf.path in rows]
    cut = [c for t in transfers if t.path in rows and (c := t.rows(*rows[t.path])) is not None]
    whole = {leaf.path for leaf in mine if rows[leaf.path] == (0, leaf.full_shape[0] if leaf.full_shape else 1)}
    return programs(mesh, axes, mine, cut, src, dst, {p: r for p, r in rows.items() if p not in whole})
