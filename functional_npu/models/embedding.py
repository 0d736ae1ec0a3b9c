"""The ends of the decoder: a vocab-parallel embedding and the head (final norm, lm_head, all_gather).

Both tables are sharded on the vocab dim over the tensor-parallel axis: this rank holds rows
``[start, start + V / tp)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.collectives import all_gather, all_reduce
from ..core.mesh import Mesh
from .linear import linear
from .norm import rms_norm

__all__ = ["embed", "head"]


def embed(params: dict, tokens: torch.Tensor, mesh: Mesh, *, tp: str) -> torch.Tensor:
    """``tokens [B, S]`` -> ``[B, S, D]``: masked lookup of this rank's rows (others are zero), then all_reduce."""
    table = params["embed"]
    rows = table.shape[0]
    local = tokens - mesh.axis_index(tp) * rows
    hit = (local >= 0) & (local < rows)
    x = F.embedding(local.clamp(0, rows - 1), table) * hit[..., None].to(table.dtype)
    return all_reduce(x, mesh, tp)


def head(params: dict, x: torch.Tensor, mesh: Mesh, *, tp: str, eps: float, tied: bool) -> torch.Tensor:
    """``x [B, S, D]`` -> logits ``[B, S, V]``: final norm, this rank's vocab slice, all_gather over ``tp``."""
    x = rms_norm(x, params["norm"], eps)
    table = params["embed"] if tied else params["lm_head"]
    return all_gather(linear(x, table), mesh, tp, dim=-1)
