"""The dense feed-forward block: a gated SiLU MLP, tensor-parallel.

``gate_up [2F, D]`` is column-parallel with fused blocks ``[gate_r | up_r]`` on each rank, ``down [D, F]``
row-parallel, followed by an all_reduce over the tensor-parallel axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.mesh import Mesh
from .linear import linear, row_parallel

__all__ = ["gated_mlp"]


def gated_mlp(layer: dict, h: torch.Tensor, mesh: Mesh, *, tp: str) -> torch.Tensor:
    """``h [B, S, D]`` (normed) -> the residual update ``[B, S, D]``, replicated over ``tp``."""
    gate, up = linear(h, layer["gate_up"]).chunk(2, dim=-1)  # column-parallel [gate_r | up_r]
    return row_parallel(F.silu(gate) * up, layer["down"], mesh, tp)
