"""Functional collectives over named mesh axes.

Each returns a new tensor (no in-place ``async_op`` calls), is built on
``torch.distributed._functional_collectives`` and traces under ``torch.compile(fullgraph=True)``
as ``_c10d_functional.*`` + ``wait_tensor`` nodes. The one exception is :func:`broadcast_into`,
which writes into memory owned outside the graph (a prefetch ring's slot): a custom op
(``functional_npu::broadcast_into``) that declares the slot it mutates, so functionalization turns
it into ``auto_functionalized_v2`` and the compilers' reinplace passes write the graph input in place
(no copy of the slot, no copy back). ``axis`` is one mesh axis or a tuple of axes
in mesh order (one group over all of them, indexed row-major). Over an axis of size 1 every
collective is the identity and emits nothing. A collective of a tensor that requires grad is
differentiable: its gradient is its transpose (:mod:`functional_npu.core.collective_grads`), the same
collectives again.

Example (row-parallel matmul, written where it happens):
    >>> y = all_reduce(x @ w_local.T, mesh, "tp")      # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol

from . import collective_grads as grads
from .mesh import Axes, Mesh
from .side_copy import side_copy, side_stream_api

__all__ = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_in_flight",
    "broadcast_into",
    "copy_into",
    "permute",
    "BROADCAST_INTO",
]

BROADCAST_INTO = "functional_npu.broadcast_into.default"  # the op as FX graphs name it

_REDUCE_OPS = ("sum", "max", "min", "product", "avg")


def _op(op: str) -> str:
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not one of {_REDUCE_OPS}")
    return op


def _tracked(x: torch.Tensor) -> bool:
    """Whether autograd records ops on ``x`` (then the collective goes through its backward rule)."""
    return x.requires_grad and torch.is_grad_enabled()


def _dim(x: torch.Tensor, dim: int, what: str) -> int:
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{what}: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.ndim


def all_reduce(x: torch.Tensor, mesh: Mesh, axis: Axes, op: str = "sum") -> torch.Tensor:
    """Reduce ``x`` over ``axis``; every rank of the group gets the result."""
    if mesh.axis_size(axis) == 1:
        return x
    if _tracked(x):
        return grads.all_reduce(x, _op(op), mesh.group_name(axis))
    return funcol.all_reduce(x, _op(op), mesh.group_name(axis))


def all_gather(x: torch.Tensor, mesh: Mesh, axis: Axes, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in index order along ``axis``."""
    if mesh.axis_size(axis) == 1:
        return x
    if _tracked(x):
        return grads.all_gather(x, _dim(x, dim, "all_gather"), mesh.group_name(axis))
    return funcol.all_gather_single(x, _dim(x, dim, "all_gather"), mesh.group_name(axis))


def reduce_scatter(x: torch.Tensor, mesh: Mesh, axis: Axes, dim: int = 0, op: str = "sum") -> torch.Tensor:
    """Reduce ``x`` over ``axis`` and keep this rank's chunk along ``dim`` (the inverse of all_gather)."""
    n = mesh.axis_size(axis)
    if n == 1:
        return x
    d = _dim(x, dim, "reduce_scatter")
    if x.shape[d] % n:
        raise ValueError(
            f"reduce_scatter over mesh axis {axis!r} (size {n}): "
            f"dim {d} of shape {tuple(x.shape)} is not divisible by {n}"
        )
    if _tracked(x):
        return grads.reduce_scatter(x, _op(op), d, mesh.group_name(axis), n)
    return funcol.reduce_scatter_single(x, _op(op), d, mesh.group_name(axis))


def all_to_all_single(
    x: torch.Tensor,
    mesh: Mesh,
    axis: Axes,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Send row-chunk ``j`` of ``x`` (dim 0) to index ``j`` along ``axis``; receive chunks concatenated by source."""
    if mesh.axis_size(axis) == 1:
        return x
    out = None if output_split_sizes is None else list(output_split_sizes)
    inp = None if input_split_sizes is None else list(input_split_sizes)
    if _tracked(x):
        return grads.all_to_all_single(x, out, inp, mesh.group_name(axis))
    return funcol.all_to_all_single(x, out, inp, mesh.group_name(axis))


def all_to_all(x: torch.Tensor, mesh: Mesh, axis: Axes, split_dim: int = 0, concat_dim: int = 0) -> torch.Tensor:
    """Split ``x`` evenly along ``split_dim`` into one chunk per rank, exchange, concatenate along ``concat_dim``.

    Example: with ``split_dim=1, concat_dim=0`` a ``[s, h]`` activation sharded on ``s`` becomes sharded on ``h``.
    """
    n = mesh.axis_size(axis)
    if n == 1:
        return x
    sd, cd = _dim(x, split_dim, "all_to_all"), _dim(x, concat_dim, "all_to_all")
    if x.shape[sd] % n:
        raise ValueError(
            f"all_to_all over mesh axis {axis!r} (size {n}): "
            f"split dim {sd} of shape {tuple(x.shape)} is not divisible by {n}"
        )
    xs = x.movedim(sd, 0)  # [n*m, ...]: chunk j (m rows) goes to index j
    recv = all_to_all_single(xs.contiguous(), mesh, axis)
    recv = recv.reshape(n, -1, *xs.shape[1:]).movedim(1, sd + 1)  # [n, ...x with the split dim cut to m...]
    return torch.cat(recv.unbind(0), dim=cd)


def _broadcast_size(mesh: Mesh, axis: Axes, src: int) -> int:
    """The size of ``axis``, after checking that ``src`` is an index along it."""
    n = mesh.axis_size(axis)
    if not 0 <= src < n:
        raise ValueError(f"broadcast: src {src} is outside mesh axis {axis!r} of size {n}")
    return n


def broadcast(x: torch.Tensor, mesh: Mesh, axis: Axes, src: int = 0) -> torch.Tensor:
    """Every rank of the group gets ``x`` of index ``src`` along ``axis``."""
    if _broadcast_size(mesh, axis, src) == 1:
        return x
    if _tracked(x):
        return grads.broadcast(x, src, mesh.group_name(axis), mesh.axis_index(axis) == src)
    return funcol.broadcast(x, src, mesh.group_name(axis))


def broadcast_in_flight(x: torch.Tensor, mesh: Mesh, axis: Axes, src: int = 0) -> torch.Tensor:
    """:func:`broadcast`, returned still in flight: a plain tensor whose bytes may not have arrived, in eager
    mode and under ``torch.compile`` alike. It may leave a compiled graph unwaited (as carried state, so
    the transfer overlaps whatever runs between two graphs and the start of the next one); whoever reads
    it first passes it through ``funcol.wait_tensor``, which waits for it (and does nothing for a tensor
    with no transfer pending)."""
    if _broadcast_size(mesh, axis, src) == 1:
        return x
    return torch.ops._c10d_functional.broadcast(x, src, mesh.group_name(axis))


@torch.library.custom_op("functional_npu::broadcast_into", mutates_args=("slot",))
def _broadcast_into(
    slot: torch.Tensor, parts: list[torch.Tensor], after: torch.Tensor | None, src: int, group_name: str, size: int
) -> None:
    """``slot <- cat(parts)`` on the source (empty ``parts`` elsewhere), then an in-place broadcast of ``slot`` from
    ``src``, left in flight (``wait_tensor(slot)`` waits). ``after`` is read by nothing: it orders the write after
    the tensor's producer (every read of the slot's previous contents). ``size`` is the group's size; with a size of
    one, ``group_name`` is empty (no broadcast) or names a link that delivers the filled slot (an emulated host link,
    :mod:`functional_npu.parallel.host_link`)."""
    if parts and all(p.device == slot.device for p in parts):
        torch.cat([p.reshape(-1) for p in parts], out=slot)
    elif parts:  # from host memory: one copy per part, asynchronous from pinned memory; on a GPU on a side stream
        side_copy(slot, parts, None if group_name else side_stream_api(slot.device, [p.device for p in parts]))
    if group_name:
        torch.ops._c10d_functional.broadcast_(slot, src, group_name)


@_broadcast_into.register_fake
def _(slot: torch.Tensor, parts: list[torch.Tensor], after: torch.Tensor | None, src: int, group_name: str, size: int):
    return None


def broadcast_into(
    slot: torch.Tensor,
    parts: Sequence[torch.Tensor],
    mesh: Mesh,
    axis: Axes,
    src: int,
    after: torch.Tensor | None = None,
) -> torch.Tensor:
    """Broadcast into ``slot`` (a flat buffer owned outside the graph) from index ``src`` along ``axis``: on ``src``,
    ``parts`` (flattened, concatenated) are written into ``slot`` first; elsewhere ``parts`` is empty. Nothing is
    allocated. The write starts only once ``after`` exists. Returns ``slot``, in flight: pass it through
    ``funcol.wait_tensor`` before reading it.

    Raises:
        ValueError: ``src`` outside the axis, or ``parts`` that do not fill ``slot`` (on the source).
    """
    n = _broadcast_size(mesh, axis, src)
    if parts:
        _check_fill("broadcast_into", slot, parts)
    torch.ops.functional_npu.broadcast_into(slot, list(parts), after, src, mesh.group_name(axis) if n > 1 else "", n)
    return slot


def copy_into(
    slot: torch.Tensor, parts: Sequence[torch.Tensor], after: torch.Tensor | None = None, link: str = ""
) -> torch.Tensor:
    """``slot <- cat(parts)`` in place, ``parts`` in host memory (or anywhere): a ring slot filled from a local
    source, the same graph op as :func:`broadcast_into` with a group of one (so every check of a ring's writes covers
    it). Nothing is allocated; from pinned host memory the copies are asynchronous, and on a GPU they run on a side
    stream beside the compute stream's work (:mod:`.side_copy`). The write starts only once
    ``after`` exists. ``link``, if given, is the registered name of a one-rank process group whose broadcast of the
    filled slot delivers it (an emulated host link: :class:`functional_npu.parallel.host_link.EmulatedHostLink`).
    Returns ``slot``: pass it through ``funcol.wait_tensor`` before reading it.

    Raises:
        ValueError: ``parts`` that do not fill ``slot``.
    """
    _check_fill("copy_into", slot, parts)
    torch.ops.functional_npu.broadcast_into(slot, list(parts), after, 0, link, 1)
    return slot


def _check_fill(where: str, slot: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Refuse ``parts`` whose elements or dtypes do not fill ``slot`` exactly."""
    if sum(p.numel() for p in parts) != slot.numel() or any(p.dtype != slot.dtype for p in parts):
        raise ValueError(
            f"{where}: parts of {sum(p.numel() for p in parts)} elements "
            f"({sorted({str(p.dtype) for p in parts})}) do not fill a slot of {slot.numel()} {slot.dtype}"
        )


def permute(x: torch.Tensor, mesh: Mesh, axis: Axes, dst: Sequence[int]) -> torch.Tensor:
    """Point-to-point exchange: index ``i`` along ``axis`` sends ``x`` to index ``dst[i]``.

    ``dst`` must be a permutation of ``range(n)``; e.g. ``[1, 2, ..., 0]`` shifts by one (a ring step).
    """
    n = mesh.axis_size(axis)
    if sorted(dst) != list(range(n)):
        raise ValueError(
            f"permute over mesh axis {axis!r} (size {n}): dst {list(dst)} is not a permutation of range({n})"
        )
    if n == 1:
        return x
    me = mesh.axis_index(axis)
    src = list(dst).index(me)
    flat = x.reshape(-1)
    numel = flat.shape[0]
    send = [numel if j == dst[me] else 0 for j in range(n)]
    recv = [numel if j == src else 0 for j in range(n)]
    return all_to_all_single(flat, mesh, axis, recv, send).reshape(x.shape)
