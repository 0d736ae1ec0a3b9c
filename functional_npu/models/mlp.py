"""The dense feed-forward block: a gated MLP (SiLU unless told otherwise), tensor-parallel.

``gate_up [2F, D]`` is column-parallel with fused blocks ``[gate_r | up_r]`` on each rank, ``down [D, F]``
row-parallel, followed by an all_reduce over the tensor-parallel axis. With module TP over
data-parallel axes ``axes`` (:mod:`functional_npu.parallel.module_tp`) ``F`` is cut over
``axes + (tp,)``: the group's rows are all-gathered, multiplied, and the partial sums reduce-scattered
back to their rank before the all_reduce over tp.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..core.collectives import all_gather, all_reduce, reduce_scatter
from ..core.mesh import Mesh
from .invariant_modes import ops as invariant_ops_of
from .linear import linear, row_amax, row_parallel

__all__ = ["gated_mlp"]


def gated_mlp(
    layer: dict,
    h: torch.Tensor,
    mesh: Mesh,
    *,
    tp: str,
    axes: tuple[str, ...] = (),
    activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    invariant: bool = False,
) -> torch.Tensor:
    """``h [B, S, D]`` (normed) -> the residual update ``[B, S, D]``, replicated over ``tp``; ``activation``:
    the gate's; ``invariant``: every reduction in one fixed order and SiLU's (:mod:`~functional_npu.models.invariant`:
    ``activation`` is then not read)."""
    if invariant:
        kern = invariant_ops_of(invariant)
        gate, up = kern.linear(h, layer["gate_up"]).chunk(2, dim=-1)
        return kern.row_parallel(kern.silu(gate) * up, layer["down"], mesh, tp)
    if mesh.axis_size(axes) == 1:
        gate, up = linear(h, layer["gate_up"]).chunk(2, dim=-1)  # column-parallel [gate_r | up_r]
        return row_parallel(activation(gate) * up, layer["down"], mesh, tp)
    x = all_gather(h, mesh, axes)  # [n B, S, D]: the group's rows
    gate, up = linear(x, layer["gate_up"]).chunk(2, dim=-1)
    act = activation(gate) * up  # [n B, S, F / (n tp)]
    y = linear(act, layer["down"], amax=row_amax(act, layer["down"], mesh, axes + (tp,)))
    return all_reduce(reduce_scatter(y, mesh, axes), mesh, tp)
