"""The ends of the decoder: a vocab-parallel embedding and the head (final norm, lm_head, all_gather).

Both tables are sharded on the vocab dim over the tensor-parallel axis: this rank holds rows
``[start, start + V / tp)``. With module TP over data-parallel axes ``axes``
(:mod:`functional_npu.parallel.module_tp`) a table is cut over ``axes + (tp,)`` instead, and the
rows of the group's ``n`` ranks are gathered first (ids for the embedding, hidden states for the head),
so each rank looks up or multiplies its ``V / (n tp)`` rows for all of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from ..core.mesh import Mesh
from .invariant_modes import ops as invariant_ops_of
from .linear import linear
from .norm import rms_norm, softcap

__all__ = ["embed", "head", "head_argmax"]


def embed(
    params: dict, tokens: torch.Tensor, mesh: Mesh, *, tp: str, axes: tuple[str, ...] = (), scale: float | None = None
) -> torch.Tensor:
    """``tokens [B, S]`` -> ``[B, S, D]``: masked lookup of this rank's rows (others are zero), then summed over
    ``tp``; with module TP over ``axes``, the group's ids are gathered and the sums scattered back. ``scale``: the
    rows are multiplied by it, rounded to float32 and then to their dtype (Gemma's ``sqrt(D)``)."""
    table = params["embed"]
    rows, n = table.shape[0], mesh.axis_size(axes)
    ids = all_gather(tokens, mesh, axes) if n > 1 else tokens  # [n B, S]
    local = ids - mesh.axis_index(axes + (tp,)) * rows
    hit = (local >= 0) & (local < rows)
    x = F.embedding(local.clamp(0, rows - 1), table) * hit[..., None].to(table.dtype)
    if n > 1:
        x = reduce_scatter(x, mesh, axes)  # [B, S, D]: this rank's rows, summed over the group's slices
    x = all_reduce(x, mesh, tp)
    return x if scale is None else x * torch.full((), scale, dtype=torch.float32, device=x.device).to(x.dtype)


def _local_logits(
    params: dict,
    x: torch.Tensor,
    mesh: Mesh,
    eps: float,
    tied: bool,
    axes: tuple[str, ...],
    norm_offset: float,
    logit_softcap: float | None,
    invariant: bool = False,
) -> torch.Tensor:
    kern = invariant_ops_of(invariant) if invariant else None
    x = (kern.rms_norm if invariant else rms_norm)(x, params["norm"], eps, norm_offset)
    if mesh.axis_size(axes) > 1:
        x = all_gather(x, mesh, axes)  # [n B, S, D]: the group's rows
    w = params["embed"] if tied else params["lm_head"]
    logits = (kern.linear if invariant else linear)(x, w)  # [(n) B, S, V / (n tp)]
    return logits if logit_softcap is None else softcap(logits, logit_softcap)


def head(
    params: dict,
    x: torch.Tensor,
    mesh: Mesh,
    *,
    tp: str,
    eps: float,
    tied: bool,
    axes: tuple[str, ...] = (),
    norm_offset: float = 0.0,
    logit_softcap: float | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """``x [B, S, D]`` -> logits ``[B, S, V]``: final norm, this rank's vocab slice, all_gather over ``tp``.
    ``norm_offset``: the final norm's (:func:`rms_norm`'s; Gemma: 1); ``logit_softcap``: the logits are soft-capped
    at it (:func:`softcap`; Gemma's ``final_logit_softcapping``); ``invariant``: the norm and the product's sum in one
    fixed order (:mod:`~functional_npu.models.invariant`).

    With module TP over ``axes`` (``n`` ranks): this rank's slice for the group's ``n B`` rows, each row's
    slices routed back to its rank (all_to_all), then gathered over ``tp``; slice ``j * tp + t`` is
    held by group index ``j`` at tp index ``t`` (mesh order).
    """
    logits = _local_logits(params, x, mesh, eps, tied, axes, norm_offset, logit_softcap, invariant)
    if mesh.axis_size(axes) == 1:
        return all_gather(logits, mesh, tp, dim=-1)
    return _home(logits, mesh, tp, axes).reshape(x.shape[0], x.shape[1], -1)  # [B, S, V]


def _home(slices: torch.Tensor, mesh: Mesh, tp: str, axes: tuple[str, ...]) -> torch.Tensor:
    """Each rank's per-row vocab slices ``[(n) B, S, w]`` -> this rank's rows' slices from every rank of the group
    and of tp, in vocab order ``[B, S, n, tp, w]``: routed back over ``axes`` (all_to_all), gathered over ``tp``;
    slice ``j * tp + t`` is held by group index ``j`` at tp index ``t`` (mesh order)."""
    n, t = mesh.axis_size(axes), mesh.axis_size(tp)
    if n > 1:
        slices = all_to_all(slices, mesh, axes)  # [n B, S, w]: my rows' slice j from group index j
    everyone = all_gather(slices, mesh, tp)  # [t n B, S, w] ordered (t, j)
    b = everyone.shape[0] // (t * n)  # "(t j b) s w -> b s j t w", written out (see models.attention.split_heads)
    return everyone.reshape(t, n, b, *everyone.shape[1:]).permute(2, 3, 1, 0, 4)


def head_argmax(
    params: dict,
    x: torch.Tensor,
    mesh: Mesh,
    *,
    tp: str,
    eps: float,
    tied: bool,
    axes: tuple[str, ...] = (),
    norm_offset: float = 0.0,
    logit_softcap: float | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Greedy tokens ``[B, S]`` (int64) without moving logits: each rank's vocab slice reduced to its (max,
    argmax) first, then only those pairs are routed (all_to_all over ``axes``, all_gather over ``tp``) and
    the first largest wins, as ``head(...).argmax(-1)`` picks it; -1 where that largest is NaN or infinite.
    (Indices travel as float32: exact for vocabularies below 2**24.)"""
    logits = _local_logits(params, x, mesh, eps, tied, axes, norm_offset, logit_softcap, invariant)  # [(n) B, S, v]
    v = logits.shape[-1]
    best, idx = logits.float().max(-1, keepdim=True)  # the first largest of this slice
    pair = torch.cat([best, (idx + mesh.axis_index(axes + (tp,)) * v).float()], dim=-1)  # [(n) B, S, 2]
    pairs = _home(pair, mesh, tp, axes).flatten(2, 3)  # [B, S, n tp, 2]: every slice's pair, in vocab order
    pick = pairs[..., 0].argmax(-1, keepdim=True)  # the first slice holding the largest value
    token = pairs[..., 1].gather(-1, pick).squeeze(-1).long()
    return torch.where(torch.isfinite(pairs[..., 0].gather(-1, pick).squeeze(-1)), token, -1)
