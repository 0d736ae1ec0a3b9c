"""Pure transforms between full trees and local shards: ``shard``, ``local_shape``, ``gather``, ``unshard``.

``shard`` and ``unshard`` are single-process (an abstract mesh is enough): ``shard`` takes the
slice one coordinate holds, ``unshard`` reassembles the full tree from every coordinate's
shards. ``gather`` does the same from inside the world with ``all_gather`` over the layout's
axes and traces under ``torch.compile(fullgraph=True)``. Inputs are never modified and outputs
never alias them. Every leaf is validated before any tensor is cut or any byte is sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import collectives
from .layout import (
    Layout,
    LayoutError,
    Piece,
    check_shape,
    dim_pieces,
    full_length,
    local_pieces,
    piece_len,
    validate,
)
from .mesh import Mesh
from .params import Params
from .tree import PyTree, expand_prefix, flatten_with_paths, map_with_path

__all__ = [
    "shard",
    "pad_to",
    "local_shape",
    "gather",
    "unshard",
    "leaf_specs",
    "check_leaf",
    "positioned",
    "full_shape",
    "as_bits",
]

# same-width carriers that every backend (gloo has no int16) moves byte for byte
_BITS = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}


def leaf_specs(specs: PyTree, tree: PyTree) -> dict[str, Layout]:
    """The layout of every leaf of ``tree``, from a spec tree that may be a prefix of it."""
    return expand_prefix(specs, tree, is_leaf=lambda x: isinstance(x, Layout), what="specs")


def check_leaf(path: str, x: object) -> torch.Tensor:
    """``x`` if it is a tensor; else a TypeError naming ``params[path]`` and the fix."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"params[{path!r}] is a {type(x).__name__}, not a torch.Tensor; convert it with torch.as_tensor"
        )
    return x


def positioned(mesh: Mesh, coordinate: Mapping[str, int] | int | None) -> Mesh:
    """``mesh`` at ``coordinate`` if given, else ``mesh`` itself, which must then have a coordinate
    (ValueError if not)."""
    if coordinate is not None:
        return mesh.at(coordinate)
    if mesh.rank is None:
        raise ValueError(
            f"mesh {mesh.shape} is abstract with no coordinate: pass coordinate={{...}} or use mesh.at(...)"
        )
    return mesh


def local_shape(
    shape: Sequence[int],
    layout: Layout,
    mesh: Mesh,
    *,
    coordinate: Mapping[str, int] | int | None = None,
    path: str = "<leaf>",
    dtype: torch.dtype = torch.int32,
) -> tuple[int, ...]:
    """The shape of the shard of a full ``shape`` held at this mesh coordinate (or ``coordinate``).

    Example:
        >>> local_shape((8, 4), sharded(0, "tp"), Mesh.abstract({"tp": 4}), coordinate=1)
        (2, 4)
    """
    check_shape(shape, f"local_shape: {path}'s shape")
    mesh = positioned(mesh, coordinate)
    validate(path, layout, shape, dtype, mesh.shape)
    out = list(shape)
    for d, pieces in enumerate(local_pieces(path, layout, shape, mesh)):
        if pieces is not None:
            out[d] = sum(map(piece_len, pieces))
    return tuple(out)


def _take(x: torch.Tensor, d: int, pieces: list[Piece]) -> torch.Tensor:
    if not pieces:
        return x.narrow(d, 0, 0)
    views = [x[(slice(None),) * d + (slice(*p),)] for p in pieces]
    return views[0] if len(views) == 1 else torch.cat(views, dim=d)


def shard(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh,
    *,
    coordinate: Mapping[str, int] | int | None = None,
    placement: Any = None,
) -> PyTree:
    """This coordinate's local tree: each leaf cut by its layout. Pure; no communication.

    Args:
        tree: full params (:class:`~functional_npu.core.params.Params`, or nested dicts / lists / registered
            pytrees of tensors).
        specs: a tree of :class:`Layout`, equal to ``tree``'s structure or a prefix of it (a placement's
            ``layouts`` are one).
        mesh: a mesh with a coordinate (from ``make_mesh``) or an abstract one plus ``coordinate``.
        coordinate: ``{"tp": 1, ...}`` or a flat rank; overrides the mesh's own.
        placement: the :class:`~functional_npu.placement.Placement` the shards are of (``place(cfg, mesh, plan)``),
            which the result carries; for ``Params`` only. None: the result carries none (the full tree's does not
            describe its shards).

    Returns:
        A new tree of new tensors (never views of the input); ``Params`` of the same config for ``Params``.

    Raises:
        TypeError, LayoutError (a ValueError), naming the leaf path, dim, sizes, mesh axis and a fix.
    """
    mesh = positioned(mesh, coordinate)
    layouts = leaf_specs(specs, tree)
    plans = {}
    for path, x in flatten_with_paths(tree):
        x = check_leaf(path, x)
        validate(path, layouts[path], x.shape, x.dtype, mesh.shape)
        plans[path] = local_pieces(path, layouts[path], x.shape, mesh)

    def cut(path: str, x: torch.Tensor) -> torch.Tensor:
        y = x
        for d, pieces in enumerate(plans[path]):
            if pieces is not None:
                y = _take(y, d, pieces)
        if y.numel() and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            return y.contiguous()  # already a fresh copy
        return y.clone(memory_format=torch.contiguous_format)

    return _placed(map_with_path(cut, tree), placement, "shard")


# ---- reassembly -----------------------------------------------------------------------------
def _whole_on_one(spec, full_len: int, n: int) -> bool:
    """Nothing to reassemble: one coordinate holds the dim whole and in order (not so for interleaved groups)."""
    return n == 1 and (spec is None or dim_pieces(spec, full_len, 1, 0) == [(0, full_len, 1)])


def _local_lens(spec, full_len: int, n: int) -> list[int]:
    return [sum(map(piece_len, dim_pieces(spec, full_len, n, j))) for j in range(n)]


def _assembly_index(
    path: str, d: int, spec, full_len: int, n: int, pad: int, slots: Sequence[int] | None = None
) -> list[int]:
    """For each full position along dim ``d``: where it sits in the concatenation of the ``n`` padded shards
    (coordinate ``j``'s shard in slot ``slots[j]``, default ``j``)."""
    src = [-1] * full_len
    for j in range(n):
        offset, slot = 0, j if slots is None else slots[j]
        for p in dim_pieces(spec, full_len, n, j):
            for k, pos in enumerate(range(*p)):
                if src[pos] < 0:  # replicas hold equal copies: take the first
                    src[pos] = slot * pad + offset + k
            offset += piece_len(p)
    if min(src, default=0) < 0:  # pragma: no cover - a layout that loses data is a planning bug
        raise LayoutError(
            f"specs[{path!r}] dim {d}: positions "
            f"{[i for i, s in enumerate(src) if s < 0][:8]} are held by no coordinate"
        )
    return src


def pad_to(x: torch.Tensor, d: int, length: int) -> torch.Tensor:
    """``x`` with zeros appended along dim ``d`` up to ``length`` (``x`` itself when it is that long)."""
    if x.shape[d] == length:
        return x
    fill = x.new_zeros(*x.shape[:d], length - x.shape[d], *x.shape[d + 1 :])
    return torch.cat([x, fill], dim=d)


def as_bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as a same-width carrier dtype (see ``_BITS``), so every backend's collectives move any
    dtype bit for bit."""
    return x.view(_BITS[x.element_size()]) if x.element_size() in _BITS else x


def full_shape(path: str, x: torch.Tensor, layout: Layout, mesh: Mesh) -> tuple[int, ...]:
    """The full shape a local shard ``x`` at this mesh coordinate implies under ``layout``.

    Raises:
        LayoutError if ``x``'s shape is not what ``layout`` gives this coordinate of that full shape.
    """
    validate(path, layout, x.shape, x.dtype, mesh.shape, local=True)
    shape = list(x.shape)
    for d, spec in enumerate(layout.dims):
        if spec is not None:
            shape[d] = full_length(spec, x.shape[d], mesh.axis_size(spec.axes))
    expect = local_shape(shape, layout, mesh, path=path, dtype=x.dtype)
    if tuple(x.shape) != expect:
        raise LayoutError(
            f"params[{path!r}] has local shape {tuple(x.shape)} but {layout!r} on mesh {mesh.shape} at "
            f"{mesh.coordinate} holds {expect} of the full {tuple(shape)}; was it sharded with another layout or mesh?"
        )
    return tuple(shape)


def gather(tree: PyTree, specs: PyTree, mesh: Mesh) -> PyTree:
    """The full tree from this rank's local tree: one ``all_gather`` per group of ranks the tree is cut over.

    Every leaf cut over the same axes (of size > 1; a leaf cut on two dims counts both dims' axes) travels in
    one collective: the leaves' local shards, each padded to the largest shard of its dims and viewed as bytes,
    concatenated; each leaf is then reassembled locally from its group's shards, as ``unshard`` does. Peak
    memory: a group's gathered bytes are held until all of its leaves are reassembled (about twice the
    gathered leaves' full size).

    One collective per process group also means no two ``all_gather`` of one group are ever in flight at
    once: on gloo (torch 2.13), two functional ``all_gather_into_tensor`` in flight on one group corrupt the
    heap (the ranks abort with ``malloc(): unaligned tcache chunk detected``), which a compiled per-leaf
    gather hit whenever inductor issued the next leaf's gather before waiting on the last.

    Collective: every rank of the mesh must call it with the same specs. Traceable with
    ``torch.compile(fullgraph=True)`` (process groups are created before tracing by the first
    eager call, or by ``mesh.init_groups()``).

    Returns:
        A new tree of full tensors, identical on every rank.
    """
    mesh = positioned(mesh, None)
    layouts = leaf_specs(specs, tree)
    leaves = dict(flatten_with_paths(tree))
    shapes, steps, groups = {}, {}, {}
    for path, x in leaves.items():
        shape = shapes[path] = full_shape(path, check_leaf(path, x), layouts[path], mesh)
        steps[path] = _steps(layouts[path], shape, mesh)
        cut = {a for _, spec, _ in steps[path] for a in spec.axes}
        groups[path] = tuple(a for a in mesh.axis_names if a in cut and mesh.axis_size(a) > 1)
    travelling = sorted({g for g in groups.values() if g})
    if not torch.compiler.is_compiling():
        mesh.init_groups(*travelling)

    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for axes in travelling:
        members = [p for p, g in groups.items() if g == axes]
        padded = {p: _padded(leaves[p], steps[p], shapes[p]) for p in members}
        sizes = {p: _aligned(padded[p].numel() * padded[p].element_size()) for p in members}
        flat = torch.cat([_bytes(padded[p], sizes[p]) for p in members])
        ranks = mesh.group_ranks(axes)
        everyone = collectives.all_gather(flat, mesh, axes).view(len(ranks), -1)
        offset = 0
        for p in members:
            n = padded[p].numel() * padded[p].element_size()
            rows = everyone[:, offset : offset + n]
            pieces[p] = {r: rows[i].view(padded[p].dtype).view(padded[p].shape) for i, r in enumerate(ranks)}
            offset += sizes[p]

    def assemble(path: str, x: torch.Tensor) -> torch.Tensor:
        if not steps[path]:
            return x.clone()
        return _reassembled(path, pieces.get(path, {mesh.rank: x}), steps[path], shapes[path], mesh)[mesh.rank]

    return _placed(map_with_path(assemble, tree), None, "gather")


def _steps(layout: Layout, shape: Sequence[int], mesh: Mesh) -> list[tuple[int, Any, int]]:
    """``(dim, spec, group size)`` of each dim of ``layout`` to reassemble: those no one coordinate holds whole and in
    order."""
    return [
        (d, spec, mesh.axis_size(spec.axes))
        for d, spec in enumerate(layout.dims)
        if spec is not None and not _whole_on_one(spec, shape[d], mesh.axis_size(spec.axes))
    ]


def _reassembled(
    path: str, state: dict[int, torch.Tensor], steps: list, shape: Sequence[int], mesh: Mesh
) -> dict[int, torch.Tensor]:
    """``state`` (rank -> its shard, for the ranks at hand) with each of ``steps`` reassembled in turn over every
    group of ranks at hand: each of those ranks then maps to the full tensor (the shards' dtype and device)."""
    for d, spec, n in steps:
        pad = max(_local_lens(spec, shape[d], n))
        device = next(iter(state.values())).device
        idx = torch.tensor(_assembly_index(path, d, spec, shape[d], n, pad), dtype=torch.long, device=device)
        for ranks in mesh.all_group_ranks(spec.axes):
            if ranks[0] in state:
                full = torch.cat([pad_to(state[r], d, pad) for r in ranks], dim=d).index_select(d, idx)
                state.update({r: full for r in ranks})
    return state


def _padded(x: torch.Tensor, steps: list, shape: Sequence[int]) -> torch.Tensor:
    """``x`` padded on each dim it is cut on to the largest shard of that dim, so every rank sends one size."""
    for d, spec, n in steps:
        x = pad_to(x, d, max(_local_lens(spec, shape[d], n)))
    return x


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to 16, so each leaf's bytes start where any dtype may be viewed."""
    return -(-nbytes // 16) * 16


def _bytes(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x``'s bytes, flat, zero-filled to ``size``."""
    flat = x.contiguous().reshape(-1).view(torch.uint8)
    return flat if flat.numel() == size else torch.cat([flat, flat.new_zeros(size - flat.numel())])


def unshard(local_trees: Sequence[PyTree], specs: PyTree, mesh: Mesh) -> PyTree:
    """The full tree from every rank's local tree (``local_trees[r]`` for world rank ``r``). Single-process.

    The inverse of ``[shard(tree, specs, mesh, coordinate=r) for r in range(mesh.size)]``.
    """
    if len(local_trees) != mesh.size:
        raise ValueError(
            f"unshard needs one local tree per rank of mesh {mesh.shape} ({mesh.size}), got {len(local_trees)}"
        )
    layouts = leaf_specs(specs, local_trees[0])
    per_rank = [dict(flatten_with_paths(t)) for t in local_trees]

    def assemble(path: str, _: torch.Tensor) -> torch.Tensor:
        layout = layouts[path]
        seen = {
            r: (full_shape(path, check_leaf(path, t[path]), layout, mesh.at(r)), t[path].dtype)
            for r, t in enumerate(per_rank)
        }
        if len(set(seen.values())) > 1:
            views = ", ".join(f"rank {r}: {s} {dt}" for r, (s, dt) in seen.items())
            raise LayoutError(
                f"params[{path!r}]: the local shards imply different full shapes "
                f"or dtypes ({views}); shard every rank with the same layout"
            )
        shape = seen[0][0]
        state = {r: per_rank[r][path] for r in range(mesh.size)}
        return _reassembled(path, state, _steps(layout, shape, mesh), shape, mesh)[0].clone()

    return _placed(map_with_path(assemble, local_trees[0]), None, "unshard")


def _placed(tree: PyTree, placement: Any, where: str) -> PyTree:
    """``tree`` carrying ``placement`` if it is :class:`Params` (a full tree's, or shards', placement never carries
    over to the other form)."""
    if isinstance(tree, Params):
        return Params(tree.tree, tree.config, placement)
    if placement is not None:
        raise TypeError(f"{where}: placement= is carried by Params; got a {type(tree).__name__} tree")
    return tree
