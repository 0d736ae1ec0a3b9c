"""``reshard``: move a tree of local shards from one layout to another in one planned exchange.

The plan is pure data computed from (full shapes, dtypes, source layouts, destination layouts,
mesh shape): for every leaf, the full tensor is cut into *atoms*, boxes on which the set of
ranks holding it (source) and the set of ranks needing it (destination) are constant. A rank
takes whatever it already holds from itself and fetches every other atom from exactly one
holder, chosen deterministically: among the holders that differ from it on the fewest mesh
axes, round-robin over atoms (spreading load over replicas). So each rank receives exactly the
bytes it needs and does not hold (the lower bound) and every destination byte is written once; on
the wire each peer's section is padded to 8 bytes, so a rank may receive up to 7 bytes per peer more.

Execution packs each rank's outgoing boxes into one flat byte buffer per peer (every dtype
moved as raw bytes), exchanges them with a single ``all_to_all_single`` over the mesh axes the
plan crosses, and unpacks into fresh destination tensors. With ``bucket_bytes`` the leaves are
grouped into buckets (whole leaves, in leaf order, :mod:`.buckets`), each exchanged with its own
``all_to_all_single`` and unpacked before the next bucket's buffers are made: a rank's send plus
receive buffers never take more than ``bucket_bytes``. It traces with
``torch.compile(fullgraph=True)``; the source tree is never modified, and everything is
validated before any byte moves.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from . import collectives
from .buckets import check_bucket_bytes, group_leaves, leaf_costs
from .layout import Layout, Piece, local_pieces, validate
from .mesh import Mesh
from .shard import check_leaf, full_shape, leaf_specs, positioned
from .tree import PyTree, flatten_with_paths, map_with_path

__all__ = [
    "Transfer",
    "LeafPlan",
    "ReshardPlan",
    "RankTraffic",
    "ReshardProgram",
    "LeafSteps",
    "plan_reshard",
    "reshard",
    "pack",
    "unpack",
    "simulate",
    "run_buckets",
]

Box = tuple[tuple[int, int], ...]  # (start, length) per dim of a local tensor
_ALIGN = 8  # every peer's section of a flat buffer starts on an 8-byte boundary (so byte chunks view back as any dtype)


@dataclass(frozen=True, slots=True)
class Transfer:
    """One box of one leaf moving from world rank ``src`` to world rank ``dst`` (``src == dst``: a local copy)."""

    path: str
    src: int
    dst: int
    src_box: Box
    dst_box: Box
    nbytes: int


@dataclass(frozen=True, slots=True)
class LeafPlan:
    """A leaf's full shape and dtype, and its local shape on every rank before and after."""

    path: str
    dtype: torch.dtype
    full_shape: tuple[int, ...]
    src_shapes: tuple[tuple[int, ...], ...]
    dst_shapes: tuple[tuple[int, ...], ...]


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
        buckets: per bucket (whole leaves, in leaf order), per rank, its part of that bucket's exchange.
    """

    mesh_shape: tuple[tuple[str, int], ...]
    axes: tuple[str, ...]
    leaves: tuple[LeafPlan, ...]
    transfers: tuple[Transfer, ...]
    traffic: tuple[RankTraffic, ...]
    programs: tuple["ReshardProgram", ...]
    bucket_bytes: int | None = None
    buckets: tuple[tuple["ReshardProgram", ...], ...] = ()

    @property
    def bucket_paths(self) -> tuple[tuple[str, ...], ...]:
        """The leaves of each bucket, in order."""
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
            out.append(Transfer(leaf.path, s, r, sbox, dbox, math.prod(lens) * item))
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
        bucket_bytes: the most bytes any rank's send plus receive buffers may take at once: the leaves are grouped
            into buckets of whole leaves in leaf order, exchanged one after another (``None``: one bucket).

    Returns:
        A :class:`ReshardPlan`; ``plan.traffic`` holds the bytes per rank and the lower bound,
        ``plan.bucket_paths`` the leaves of each bucket.

    Raises:
        ValueError / TypeError: a layout that does not fit, a ``bucket_bytes`` that is not a positive int or is
        below what one leaf alone takes on some rank (naming the leaf and the least bucket size).

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
    costs = leaf_costs((t.path, t.src, t.dst, t.nbytes) for t in transfers)
    groups = group_leaves(list(order), {p: costs.get(p, Counter()) for p in order}, bucket_bytes)
    programs = _programs(mesh, axes, leaves, transfers, src_specs, dst_specs)
    buckets = (
        (programs,)
        if len(groups) == 1
        else tuple(_bucket(g, mesh, axes, leaves, transfers, src_specs, dst_specs) for g in groups)
    )
    return ReshardPlan(
        tuple(mesh.shape.items()), axes, tuple(leaves), tuple(transfers), traffic, programs, bucket_bytes, buckets
    )


# ---- execution ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LeafSteps:
    """One leaf's part of a rank's exchange: its destination shape and dtype, the boxes it packs (source box, byte
    offset in the send buffer), copies locally (source box, destination box) and unpacks (destination box, byte
    offset in the receive buffer, bytes)."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    send: tuple[tuple[Box, int], ...]
    local: tuple[tuple[Box, Box], ...]
    recv: tuple[tuple[Box, int, int], ...]


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


def _program(
    mesh: Mesh, r: int, axes: tuple[str, ...], leaves: Sequence[LeafPlan], transfers: Sequence[Transfer], src, dst
):
    group = mesh.at(r).group_ranks(axes) if axes else (r,)
    sends = [[t for t in transfers if t.src == r != t.dst == peer] for peer in group]
    recvs = [[t for t in transfers if t.dst == r != t.src == peer] for peer in group]
    locals_ = [t for t in transfers if t.src == r == t.dst]
    sent, send_sizes, pads = _laid_out(sends)
    got, recv_sizes, _ = _laid_out(recvs)
    steps = tuple(
        LeafSteps(
            leaf.path,
            leaf.dst_shapes[r],
            leaf.dtype,
            tuple((t.src_box, at) for t, at in sent if t.path == leaf.path),
            tuple((t.src_box, t.dst_box) for t in locals_ if t.path == leaf.path),
            tuple((t.dst_box, at, t.nbytes) for t, at in got if t.path == leaf.path),
        )
        for leaf in leaves
    )
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


def _programs(
    mesh: Mesh,
    axes: tuple[str, ...],
    leaves: Sequence[LeafPlan],
    transfers: Sequence[Transfer],
    src: Mapping[str, Layout],
    dst: Mapping[str, Layout],
) -> tuple[ReshardProgram, ...]:
    return tuple(_program(mesh, r, axes, leaves, transfers, src, dst) for r in range(mesh.size))


def _bucket(paths, mesh, axes, leaves, transfers, src, dst) -> tuple[ReshardProgram, ...]:
    """Every rank's program for the bucket of ``paths`` (the plan's axes, so every bucket runs over one group)."""
    inside = set(paths)
    mine = [leaf for leaf in leaves if leaf.path in inside]
    return _programs(mesh, axes, mine, [t for t in transfers if t.path in inside], src, dst)


def _box(x: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (start, n) in enumerate(box):
        x = x.narrow(d, start, n)
    return x


Source = Callable[[str], torch.Tensor]


def _pack(source: Source, program: ReshardProgram, device: torch.device) -> torch.Tensor:
    """The send buffer, filled a leaf at a time (``source(path)`` once per leaf that sends, dropped after)."""
    buf = torch.empty(sum(program.send_sizes), dtype=torch.uint8, device=device)
    for at, n in program.pads:
        buf[at : at + n].zero_()  # alignment padding
    for step in program.steps:
        if step.send:
            x = source(step.path)
            for box, at in step.send:
                part = _box(x, box)
                n = part.numel() * part.element_size()
                buf[at : at + n].view(part.dtype).view(part.shape).copy_(part)
            del x, part
    return buf


def pack(local: Mapping[str, torch.Tensor], program: ReshardProgram) -> torch.Tensor:
    """This rank's outgoing bytes as one flat uint8 buffer: a section per group peer (``program.send_sizes``).

    Each box is copied once, straight into its place in the buffer (viewed as the leaf's dtype).
    """
    return _pack(local.__getitem__, program, _device(local))


def _device(local: Mapping[str, torch.Tensor]) -> torch.device:
    return next(iter(local.values())).device if local else torch.device("cpu")


def _unpack(
    source: Source, received: torch.Tensor, program: ReshardProgram, done: Callable[[str, torch.Tensor], None]
) -> None:
    """Each destination leaf in turn: made, filled from ``source`` and ``received``, handed to ``done``."""
    for step in program.steps:
        out = torch.empty(step.shape, dtype=step.dtype, device=received.device)
        if step.local:
            x = source(step.path)
            for sbox, dbox in step.local:
                _box(out, dbox).copy_(_box(x, sbox))
            del x
        for dbox, at, nbytes in step.recv:
            chunk = received[at : at + nbytes].view(step.dtype).view(tuple(n for _, n in dbox))
            _box(out, dbox).copy_(chunk)
        done(step.path, out)
        del out


def unpack(
    local: Mapping[str, torch.Tensor], received: torch.Tensor, program: ReshardProgram
) -> dict[str, torch.Tensor]:
    """The destination leaves of one rank: its local copies from ``local`` plus the boxes in ``received``."""
    out: dict[str, torch.Tensor] = {}
    _unpack(local.__getitem__, received, program, out.__setitem__)
    return out


def simulate(local_trees: Sequence[Mapping[str, torch.Tensor]], plan: ReshardPlan) -> list[dict[str, torch.Tensor]]:
    """Run ``plan`` for every rank in one process, bucket by bucket (each exchange done by slicing buffers):
    ``[dst leaves of rank r]``."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in local_trees]
    for progs in plan.buckets or (plan.programs,):
        packed = [pack(local_trees[r], progs[r]) for r in range(len(progs))]
        for r, prog in enumerate(progs):
            parts = []
            for peer in prog.group:
                j = progs[peer].group.index(r)
                offsets = progs[peer].send_sizes
                parts.append(packed[peer][sum(offsets[:j]) : sum(offsets[: j + 1])])
            out[r] |= unpack(local_trees[r], torch.cat(parts), prog)
    return out


def run_buckets(
    plan: ReshardPlan,
    mesh: Mesh,
    source: Source,
    done: Callable[[str, torch.Tensor], None],
    device: torch.device,
) -> None:
    """This rank's part of ``plan``, bucket by bucket: each bucket's buffers are packed (``source(path)``: this
    rank's local shard of a leaf, asked once per use and not kept), exchanged with one ``all_to_all_single`` and
    unpacked (``done(path, tensor)``: each destination leaf, in leaf order) before the next bucket's are made.
    A bucket in which no rank moves a byte runs no collective. Collective: every rank calls it with the plan."""
    for progs in plan.buckets or (plan.programs,):
        program = progs[mesh.rank]
        moves = any(sum(p.send_sizes) for p in progs)
        received = _exchange(source, program, plan.axes if moves else (), mesh, device)
        _unpack(source, received, program, done)
        del received


# ---- the public transform -------------------------------------------------------------------
def reshard(
    tree: PyTree,
    src_specs: PyTree,
    dst_specs: PyTree,
    mesh: Mesh,
    *,
    plan: ReshardPlan | None = None,
    bucket_bytes: int | None = None,
) -> PyTree:
    """This rank's tree in ``dst_specs`` from its tree in ``src_specs``: one planned ``all_to_all_single``, or one
    per bucket.

    Collective: every rank of the mesh calls it with the same specs. Each rank receives only the
    bytes it needs and does not already hold, each from one holder (and the padding that starts each
    peer's section on an 8-byte boundary). Traceable with
    ``torch.compile(fullgraph=True)`` (create the process groups first: run once eagerly or call
    ``mesh.init_groups(plan.axes)``).

    Args:
        tree: this rank's local shards, laid out by ``src_specs``.
        src_specs, dst_specs: trees of :class:`Layout` (each may be a prefix of ``tree``).
        mesh: a mesh with this rank's coordinate (from ``make_mesh``).
        plan: a plan from :func:`plan_reshard` for these shapes and specs (else computed here).
        bucket_bytes: the most bytes this rank's send plus receive buffers take at once: whole leaves are
            exchanged in buckets, in leaf order, each unpacked before the next is packed (``None``: one exchange).
            With ``plan``, it must be the plan's own.

    Returns:
        A new tree (same structure, never aliasing ``tree``) of local shards laid out by ``dst_specs``.

    Raises:
        TypeError, LayoutError (a ValueError) naming the leaf, dim, sizes and mesh axis, before any byte moves;
        ValueError for a ``bucket_bytes`` that is not positive or is below what one leaf alone takes.

    Example:
        >>> inference = reshard(train, megatron_specs(cfg), llama.param_specs(cfg), mesh)   # doctest: +SKIP
    """
    mesh = positioned(mesh, None)
    check_bucket_bytes(bucket_bytes, "reshard")
    src, dst = leaf_specs(src_specs, tree), leaf_specs(dst_specs, tree)
    local = {path: check_leaf(path, x) for path, x in flatten_with_paths(tree)}
    plan = _plan_for(local, src, dst, mesh, plan, bucket_bytes)
    check_program(plan, mesh.rank, local, src, dst)
    out: dict[str, torch.Tensor] = {}

    def done(path: str, x: torch.Tensor) -> None:
        out[path] = x

    run_buckets(plan, mesh, local.__getitem__, done, _device(local))
    return map_with_path(lambda path, _: out[path], tree)


def _plan_for(
    local: Mapping[str, torch.Tensor],
    src: Mapping[str, Layout],
    dst: Mapping[str, Layout],
    mesh: Mesh,
    plan: ReshardPlan | None,
    bucket_bytes: int | None = None,
) -> ReshardPlan:
    """``plan``, checked to be for this mesh, or a new plan for these local shards (which validates every layout)."""
    if plan is None:
        shapes = {path: (full_shape(path, x, src[path], mesh), x.dtype) for path, x in local.items()}
        return plan_reshard(shapes, src, dst, mesh, bucket_bytes=bucket_bytes)  # validates every destination layout
    if dict(plan.mesh_shape) != mesh.shape:
        raise ValueError(
            f"reshard: the plan is for mesh {dict(plan.mesh_shape)} "
            f"but the mesh is {mesh.shape}; plan again with this mesh"
        )
    if bucket_bytes is not None and bucket_bytes != plan.bucket_bytes:
        raise ValueError(
            f"reshard: the plan was made with bucket_bytes={plan.bucket_bytes}, but bucket_bytes={bucket_bytes} was "
            f"given; plan again with bucket_bytes={bucket_bytes}, or leave it out to run the plan's buckets"
        )
    return plan


def _exchange(
    source: Source, program: ReshardProgram, axes: tuple[str, ...], mesh: Mesh, device: torch.device
) -> torch.Tensor:
    """The bytes this rank receives: one ``all_to_all_single`` over ``axes`` (none when ``axes`` is empty)."""
    if not axes:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if not torch.compiler.is_compiling():
        mesh.init_groups(axes)
    buf = _pack(source, program, device)
    return collectives.all_to_all_single(buf, mesh, axes, program.recv_sizes, program.send_sizes)


def check_program(
    plan: ReshardPlan,
    rank: int,
    local: Mapping[str, torch.Tensor],
    src: Mapping[str, Layout],
    dst: Mapping[str, Layout],
) -> None:
    """Raise (before any byte moves) unless ``plan`` was made for these leaves, shapes, dtypes and layouts on
    ``rank`` (``local``: the tensors, or meta tensors of their shapes and dtypes)."""
    program = plan.programs[rank]
    planned = [p for p, _, _, _, _ in program.leaves]
    if planned != list(local):
        missing, extra = [p for p in local if p not in planned], [p for p in planned if p not in local]
        if missing or extra:
            what = "; ".join(
                f"{label} {len(ps)} leaves ({', '.join(ps[:3])}{', ...' if len(ps) > 3 else ''})"
                for label, ps in (("it lacks the tree's", missing), ("it has", extra))
                if ps
            )
            what += " the tree does not" if extra else ""
        else:
            first = next(i for i, (a, b) in enumerate(zip(planned, local)) if a != b)
            tree = list(local)[first]
            what = f"it orders the same leaves otherwise (at #{first}: {planned[first]!r}, the tree {tree!r})"
        raise ValueError(f"reshard: the plan was made for another tree: {what}; plan again for this tree")
    for path, shape, dtype, src_layout, dst_layout in program.leaves:
        x = local[path]
        if tuple(x.shape) != shape or x.dtype != dtype:
            raise ValueError(
                f"reshard: params[{path!r}] is {tuple(x.shape)} {x.dtype} on rank {rank} but the plan expects {shape} "
                f"{dtype} for {src_layout!r}; was it sharded with another layout or mesh? plan again for this tree"
            )
        if src[path] != src_layout or dst[path] != dst_layout:
            raise ValueError(
                f"reshard: the plan was made for params[{path!r}] going {src_layout!r} -> {dst_layout!r}, but these "
                f"params go {src[path]!r} -> {dst[path]!r}; plan again for these layouts"
            )
