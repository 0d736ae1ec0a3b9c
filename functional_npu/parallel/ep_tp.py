"""Expert weights between an expert-parallel and a tensor-parallel layout on the same ranks.

The stacked experts of one MoE layer are ``experts_gate_up`` ``[E, 2F, D]`` (gate rows, then up
rows) and ``experts_down`` ``[E, D, F]``. Over a mesh axis (or axes) of size ``n``:

* EP layout: dim 0 sharded, rank ``j`` holds experts ``[j*E/n, (j+1)*E/n)`` whole:
  ``sharded(0, axis)`` for both leaves.
* TP layout: every expert on every rank, each cut inside: gate and up are two blocks of the
  column layout, ``fused(1, [gate:F | up:F], axis)``, and down is row-parallel, ``sharded(2, axis)``.

Either direction is one even ``all_to_all`` per leaf: rank ``j`` sends to rank ``c`` the ``c``-th
column chunk (of gate and of up) of its experts, or, going back, the ``j``-th group of experts of
its column chunk. Pure (new tensors out) and traceable with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import collectives
from ..core.layout import Block, Layout, fused, sharded
from ..core.mesh import Axes, Mesh
from ..core.shard import as_bits
from ..core.tree import PyTree, flatten_with_paths, map_with_path
from .eplb_map import EXPERT_LEAVES

__all__ = ["expert_layouts", "ep_to_tp", "tp_to_ep"]

_GATE_UP, _DOWN = EXPERT_LEAVES


def expert_layouts(kind: str, ffn: int, axis: Axes) -> dict[str, Layout]:
    """The layouts of ``experts_gate_up`` and ``experts_down`` in the ``"ep"`` or ``"tp"`` form.

    Args:
        kind: "ep" (experts split over ``axis``) or "tp" (every expert split inside over ``axis``).
        ffn: F, the intermediate size of one expert (gate and up are F rows each).
        axis: the mesh axis, or axes in mesh order.

    Example:
        >>> expert_layouts("tp", 8, "ep")["experts_gate_up"]
        Layout(dim1=shard(ep [gate:8|up:8]))
    """
    if kind == "ep":
        return {_GATE_UP: sharded(0, axis), _DOWN: sharded(0, axis)}
    if kind == "tp":
        return {_GATE_UP: fused(1, [Block("gate", ffn), Block("up", ffn)], axis), _DOWN: sharded(2, axis)}
    raise ValueError(f"expert_layouts: kind must be 'ep' or 'tp', got {kind!r}")


# ---- per-leaf pack / unpack (the exchange between them is one even all_to_all) ----------------
def _pack(name: str, x: torch.Tensor, n: int, to_tp: bool) -> torch.Tensor:
    """``[n, ...]``: row ``c`` is what this rank sends to index ``c`` along the axis."""
    if to_tp and name == _GATE_UP:  # [s, 2F, D] -> [n, s, 2, F/n, D]
        s, two_f, d = x.shape
        return x.reshape(s, 2, n, two_f // (2 * n), d).permute(2, 0, 1, 3, 4).contiguous()
    if to_tp:  # down [s, D, F] -> [n, s, D, F/n]
        s, d, f = x.shape
        return x.reshape(s, d, n, f // n).permute(2, 0, 1, 3).contiguous()
    return x.reshape(n, x.shape[0] // n, *x.shape[1:]).contiguous()  # [S, ...] -> [n, S/n, ...]


def _unpack(name: str, recv: torch.Tensor, to_tp: bool) -> torch.Tensor:
    """The new local leaf from ``recv`` ``[n, ...]`` (row ``j`` came from index ``j``)."""
    n = recv.shape[0]
    if to_tp and name == _GATE_UP:  # [n, s, 2, F/n, D] -> [S, 2F/n, D]
        return recv.reshape(n * recv.shape[1], -1, recv.shape[-1])
    if to_tp:  # [n, s, D, F/n] -> [S, D, F/n]
        return recv.reshape(n * recv.shape[1], *recv.shape[2:])
    if name == _GATE_UP:  # [n, s, 2F/n, D] -> [s, 2, n, F/n, D] -> [s, 2F, D]
        _, s, cols, d = recv.shape
        return recv.reshape(n, s, 2, cols // 2, d).permute(1, 2, 0, 3, 4).reshape(s, n * cols, d).contiguous()
    _, s, d, f = recv.shape  # [n, s, D, F/n] -> [s, D, F]
    return recv.permute(1, 2, 0, 3).reshape(s, d, n * f).contiguous()


def _exchange(buf: torch.Tensor, mesh: Mesh, axis: Axes) -> torch.Tensor:
    flat = as_bits(buf).reshape(buf.shape[0], -1)
    out = collectives.all_to_all_single(flat, mesh, axis)
    return out.view(buf.dtype).reshape(buf.shape)


# ---- validation ------------------------------------------------------------------------------
def _check(leaves: list[tuple[str, str, torch.Tensor]], n: int, axis: Axes, to_tp: bool) -> None:
    fix = "use an axis size that divides it, or pad the experts"
    ffn: dict[str, tuple[str, int]] = {}
    for path, name, x in leaves:
        where = f"params[{path!r}]"
        if not isinstance(x, torch.Tensor) or x.ndim != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{where} is {shape}; "
                f"expected a stacked expert tensor of 3 dims ({'[E, 2F, D]' if name == _GATE_UP else '[E, D, F]'})"
            )
        if name == _GATE_UP and x.shape[1] % 2:
            raise ValueError(
                f"{where} has {x.shape[1]} rows on dim 1 (shape {tuple(x.shape)}), "
                f"an odd number, so it is not [gate | up]; expected 2F rows"
            )
        if to_tp:
            f = x.shape[1] // 2 if name == _GATE_UP else x.shape[2]
            if f % n:
                dim = 1 if name == _GATE_UP else 2
                raise ValueError(
                    f"{where} (shape {tuple(x.shape)}): the expert intermediate size F = {f} on dim {dim} is "
                    f"cut over mesh axis {axis!r} (size {n}) in the TP layout, but {n} does not divide {f}; {fix}"
                )
        else:
            f = n * (x.shape[1] // 2 if name == _GATE_UP else x.shape[2])
            if x.shape[0] % n:
                raise ValueError(
                    f"{where} (shape {tuple(x.shape)}) holds {x.shape[0]} experts on dim 0, which the EP layout "
                    f"splits over mesh axis {axis!r} (size {n}), but {n} does not divide {x.shape[0]}; {fix}"
                )
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if parent in ffn and ffn[parent][1] != f:
            raise ValueError(
                f"{where} implies expert intermediate size F = {f} but params[{ffn[parent][0]!r}] "
                f"implies {ffn[parent][1]}; gate_up is [E, 2F, D] and down [E, D, F]"
            )
        ffn[parent] = (path, f)


def _convert(tree: PyTree, mesh: Mesh, axis: Axes, to_tp: bool) -> PyTree:
    n = mesh.axis_size(axis)
    leaves = [
        (p, p.rsplit(".", 1)[-1], x) for p, x in flatten_with_paths(tree) if p.rsplit(".", 1)[-1] in (_GATE_UP, _DOWN)
    ]
    if not leaves:
        raise ValueError(
            f"{'ep_to_tp' if to_tp else 'tp_to_ep'}: params have no '{_GATE_UP}' or '{_DOWN}' leaf; nothing to convert"
        )
    _check(leaves, n, axis, to_tp)

    def one(path: str, x: Any) -> Any:
        name = path.rsplit(".", 1)[-1]
        if name not in (_GATE_UP, _DOWN):
            return x
        if n == 1:
            return x.clone()
        return _unpack(name, _exchange(_pack(name, x, n, to_tp), mesh, axis), to_tp)

    return map_with_path(one, tree)


def ep_to_tp(params: PyTree, mesh: Mesh, axis: Axes) -> PyTree:
    """Expert leaves from the EP layout to the TP layout over ``axis`` (see :func:`expert_layouts`).

    Collective over ``axis``. Every leaf named ``experts_gate_up`` (local ``[E/n, 2F, D]``) or
    ``experts_down`` (``[E/n, D, F]``) becomes ``[E, 2F/n, D]`` (this rank's gate and up columns)
    or ``[E, D, F/n]``; other leaves are passed through. All leaves are checked before any byte is sent.

    Args:
        params: a tree of local shards (one layer's dict, or a whole params tree).
        mesh: a mesh with a coordinate; ``axis`` the axis (or axes, in mesh order) of both layouts.

    Returns:
        A new tree; the inputs are not modified.

    Example:
        >>> tp = ep_to_tp({"experts_gate_up": gu, "experts_down": dn}, mesh, "ep")   # doctest: +SKIP
    """
    return _convert(params, mesh, axis, to_tp=True)


def tp_to_ep(params: PyTree, mesh: Mesh, axis: Axes) -> PyTree:
    """The inverse of :func:`ep_to_tp`: expert leaves from the TP layout back to the EP layout (one all_to_all each).

    Example:
        >>> ep = tp_to_ep(ep_to_tp(experts, mesh, "ep"), mesh, "ep")    # bit for bit the input   # doctest: +SKIP
    """
    return _convert(params, mesh, axis, to_tp=False)
