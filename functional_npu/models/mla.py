"""Multi-head latent attention (DeepSeek-V2/V3), tensor-parallel over heads, with a latent KV cache.

A layer's leaves: ``q_proj [H (dn + dr), D]``, or ``q_a_proj [Rq, D]`` + ``q_a_norm [Rq]`` + ``q_b_proj
[H (dn + dr), Rq]`` when the query is low-rank; ``kv_a_proj [R + dr, D]`` (the latent and the shared rope
key), ``kv_a_norm [R]``, ``kv_b_proj [H (dn + dv), R]`` (each head's key and value parts) and ``o_proj
[D, H dv]``. ``q_b_proj`` / ``q_proj`` and ``kv_b_proj`` are column-parallel over heads, ``o_proj``
row-parallel; the ``*_a_*`` projections and the cache are replicated.

The cache holds, per token, the normed latent ``c [R]`` and the rotated rope key ``k_rot [dr]``: one
``(c [B, 1, C, R], k_rot [B, 1, C, dr])`` pair per layer, ``R + dr`` values a token for all heads (a
per-head cache holds ``H (dn + dr + dv)``). Two ways to attend over it:

- **plain** (prefill): expand the cache through ``kv_b_proj`` into every head's keys and values, then
  attention as usual;
- **absorbed** (decode, the plan's ``absorb``): fold ``kv_b_proj``'s key part into the query (``q_lat = q_nope W_uk``,
  scores ``q_lat c^T + q_rot k_rot^T``) and its value part into the output (``o = (P c) W_uv^T``), so a step
  reads the latent cache once and never materializes keys or values. A quantized ``kv_b_proj`` decodes the
  plain way.

The plan's ``mla_cache = "heads"`` caches every head's keys and values instead: the baseline the latent cache
is measured against.

Rotary embedding on the ``dr`` rope dims only, with yarn scaling as transformers computes it (the
``attention_factor`` on cos / sin, the softmax scale times ``mscale(factor, mscale_all_dim)^2``), and
DeepSeek's interleaved pair layout (``rope_interleave``).

In the plan's ``invariant`` mode (:mod:`functional_npu.models.invariant`) prefill, decode and the training forward all
take the plain form (the absorbed one reduces in another order), over either cache: linears and norms by trees,
cos / sin by the polynomial ``sin_cos``, attention by :func:`~functional_npu.models.invariant.attend`, o_proj by
:func:`~functional_npu.models.invariant_ops.row_parallel` (the unsharded linear's bits at any tp).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol

import torch

from ..core.mesh import Mesh
from ..parallel.plan import Plan
from .attention import attend, attention_mask, merge_heads, output_projection, split_heads
from .invariant_modes import ops as invariant_ops_of
from .linear import dense, linear
from .norm import rms_norm
from .paged import PagedKV, indices, paged

__all__ = [
    "LatentAttention",
    "MlaStep",
    "rope_frequencies",
    "softmax_scale",
    "prepare",
    "mla",
    "init_kv",
    "local_heads",
]


class LatentAttention(Protocol):
    """The config fields multi-head latent attention reads (any family that runs it)."""

    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_type: str
    rope_theta: float
    rope_factor: float
    rope_original_max_positions: int
    rope_beta_fast: float
    rope_beta_slow: float
    rope_mscale: float
    rope_mscale_all_dim: float
    rope_attention_factor: float | None
    rope_truncate: bool
    rope_interleave: bool


KV = tuple[torch.Tensor, torch.Tensor]


class MlaStep(NamedTuple):
    """What every MLA layer of one step shares: rotary ``cos`` / ``sin`` ``[B, 1, S, dr]``, the mask
    ``[B, 1, S, C]`` and the cache slots of the new latents ``[B, 1, S, R]`` and rope keys ``[B, 1, S, dr]``."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor
    slot_c: torch.Tensor | None
    slot_r: torch.Tensor | None
    read: torch.Tensor | None = None  # a paged cache's flat pool rows (models.paged.indices): every position's
    write: torch.Tensor | None = None  # and this step's


def local_heads(cfg: LatentAttention, tp: int) -> int:
    return cfg.num_heads // tp


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: LatentAttention) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[dr / 2]``, the factor on cos / sin): default, or yarn as transformers computes it."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if cfg.rope_type != "yarn":
        return 1.0 / pos, 1.0
    factor = cfg.rope_factor
    if cfg.rope_attention_factor is not None:
        attention = cfg.rope_attention_factor
    elif cfg.rope_mscale and cfg.rope_mscale_all_dim:
        attention = _mscale(factor, cfg.rope_mscale) / _mscale(factor, cfg.rope_mscale_all_dim)
    else:
        attention = _mscale(factor)

    def correction(rotations: float) -> float:
        return dim * math.log(cfg.rope_original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(cfg.rope_beta_fast), correction(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation, attention


def softmax_scale(cfg: LatentAttention) -> float:
    """``(dn + dr) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under yarn (as transformers)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_type != "default" and cfg.rope_mscale_all_dim:
        scale *= _mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def prepare(
    cfg: LatentAttention, positions: torch.Tensor, kv: KV, dtype: torch.dtype, invariant: bool = False
) -> MlaStep:
    """The per-step values every layer shares, for ``positions [B, S]`` and a layer's cache ``kv``; ``invariant``:
    cos / sin by :func:`~functional_npu.models.invariant.sin_cos`."""
    b, s = positions.shape
    freq, factor = rope_frequencies(cfg)
    freqs = positions[..., None].float() * freq.to(positions.device)  # [B, S, dr / 2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, S, dr]
    sin, cos = invariant_ops_of(invariant).sin_cos(emb) if invariant else (emb.sin(), emb.cos())
    cos, sin = (cos * factor).to(dtype), (sin * factor).to(dtype)
    if isinstance(kv, PagedKV):  # blocks of the latent (or of the heads' keys and values)
        read, write = indices(kv.table, positions, kv.k.shape[1])
        return MlaStep(cos, sin, attention_mask(positions, read.shape[1], None), None, None, read, write)
    mask = attention_mask(positions, kv[0].shape[2], None)
    at = positions[:, None, :, None]  # the cache slots, shaped like either cache's new entries
    slot_c = at.expand(b, kv[0].shape[1], s, kv[0].shape[3])
    return MlaStep(cos, sin, mask, slot_c, at.expand(b, kv[1].shape[1], s, kv[1].shape[3]))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The rotary embedding on ``x [..., dr]``: pairs ``(x0, x1), (x2, x3), ...`` when ``interleave`` (the
    result laid out as ``[evens | odds]``, the same for queries and keys, so their products are unchanged),
    else the two halves."""
    if interleave:
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _kernels(invariant: bool | str) -> tuple:
    """(linear, rms_norm) of the invariant mode ``invariant``, or the plain ones."""
    if not invariant:
        return linear, rms_norm
    kern = invariant_ops_of(invariant)
    return kern.linear, kern.rms_norm


def _query(layer: dict, h: torch.Tensor, eps: float, invariant: bool | str = False) -> torch.Tensor:
    lin, norm = _kernels(invariant)
    if "q_proj" in layer:
        return lin(h, layer["q_proj"])
    return lin(norm(lin(h, layer["q_a_proj"]), layer["q_a_norm"], eps), layer["q_b_proj"])


def mla(
    layer: dict, h: torch.Tensor, step: MlaStep, kv: KV, mesh: Mesh, *, cfg: LatentAttention, plan: Plan, kind: str
) -> torch.Tensor:
    """``h [B, S, D]`` (normed) -> the residual update ``[B, S, D]``; writes this step's latents into ``kv``.
    Heads are split over ``plan.tp``; ``plan.absorb`` / ``plan.mla_cache`` pick the decode path and the cache;
    ``plan.invariant``: the plain form always, every reduction in one fixed order
    (:mod:`~functional_npu.models.invariant`)."""
    s = h.shape[1]
    tp, invariant = plan.tp, plan.invariant
    dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    nh = local_heads(cfg, mesh.axis_size(tp))
    query = _query(layer, h, cfg.rms_norm_eps, invariant)
    q = split_heads(query, query.shape[-1] // nh)  # [B, nh, S, dn + dr]
    q_nope, q_rot = q.split([dn, dr], dim=-1)
    lin, norm = _kernels(invariant)
    c, k_rot = lin(h, layer["kv_a_proj"]).split([r, dr], dim=-1)  # [B, S, R], [B, S, dr]
    c = norm(c, layer["kv_a_norm"], cfg.rms_norm_eps)[:, None]  # [B, 1, S, R]
    q_rot = _rotate(q_rot, step.cos, step.sin, cfg.rope_interleave)
    k_rot = _rotate(k_rot[:, None], step.cos, step.sin, cfg.rope_interleave)  # [B, 1, S, dr]
    scale = softmax_scale(cfg)
    if plan.mla_cache == "heads":  # the baseline: every head's keys and values cached
        keys, values = _store(kv, *_expand(layer["kv_b_proj"], c, k_rot, nh, dn, dv, invariant), step)
        out = _attend(torch.cat([q_nope, q_rot], dim=-1), keys, values, step.mask, scale, kind, invariant)
    else:
        kv = _store(kv, c, k_rot, step)
        w_kv = dense(layer["kv_b_proj"])
        # (quantized: plain; invariant: plain in prefill, decode and training alike, the absorbed form reduces in
        # another order)
        if plan.absorb and s == 1 and w_kv is not None and not invariant:
            out = _absorbed(w_kv, q_nope, q_rot, kv, step.mask, scale, nh, dn)
        else:
            out = _plain(layer["kv_b_proj"], q_nope, q_rot, kv, step.mask, scale, kind, nh, dn, dv, invariant)
    attn = merge_heads(out)
    if invariant:
        return invariant_ops_of(invariant).row_parallel(attn, layer["o_proj"], mesh, tp)
    return output_projection(attn, layer["o_proj"], mesh, tp=tp, axes=plan.module_tp.o_proj)


def _store(kv: KV, first: torch.Tensor, second: torch.Tensor, step: MlaStep) -> KV:
    """Write this step's cache entries (``[B, 1, S, R]`` latents and ``[B, 1, S, dr]`` rope keys, or the heads'
    keys and values) into ``kv`` in place; returns what attention reads: the cache, or a paged cache's pools
    gathered at ``step.read``."""
    if step.write is not None:
        return paged(kv[0], first, step.write, step.read), paged(kv[1], second, step.write, step.read)
    kv[0].scatter_(2, step.slot_c, first)
    kv[1].scatter_(2, step.slot_r, second)
    return kv


def _attend(q, keys, values, mask, scale: float, kind: str, invariant: bool) -> torch.Tensor:
    """Attention ``[B, nh, S, dv]`` by ``kind``, or (``invariant``) :func:`~functional_npu.models.invariant.attend`."""
    if invariant:
        return invariant_ops_of(invariant).attend(q, keys, values, mask, scale)
    return attend(q, keys, values, mask, kind, scale=scale)


def _expand(w_kv, latent: torch.Tensor, k_rot: torch.Tensor, nh: int, dn: int, dv: int, invariant: bool = False) -> KV:
    """Every head's keys ``[B, nh, L, dn + dr]`` and values ``[B, nh, L, dv]`` from latents ``[B, 1, L, R]``."""
    b, _, length, _ = latent.shape
    expanded = _kernels(invariant)[0](latent[:, 0], w_kv)
    expanded = split_heads(expanded, expanded.shape[-1] // nh)  # [B, nh, L, dn + dv]
    k_nope, values = expanded.split([dn, dv], dim=-1)
    return torch.cat([k_nope, k_rot.expand(b, nh, length, k_rot.shape[-1])], dim=-1), values


def _plain(
    w_kv, q_nope, q_rot, kv: KV, mask, scale: float, kind: str, nh: int, dn: int, dv: int, invariant: bool = False
) -> torch.Tensor:
    """Every head's keys and values expanded from the cache, then attention: ``[B, nh, S, dv]``."""
    keys, values = _expand(w_kv, kv[0], kv[1], nh, dn, dv, invariant)
    return _attend(torch.cat([q_nope, q_rot], dim=-1), keys, values, mask, scale, kind, invariant)


def _absorbed(w_kv, q_nope, q_rot, kv: KV, mask, scale: float, nh: int, dn: int) -> torch.Tensor:
    """Attention in the latent space: ``kv_b_proj``'s key part folded into the query, its value part into the
    output; the cache is read as it is, once per step: ``[B, nh, S, dv]``."""
    latent, k_rot = kv  # [B, 1, C, R], [B, 1, C, dr]
    w = w_kv.view(nh, -1, latent.shape[-1])  # [nh, dn + dv, R]
    q_lat = torch.einsum("bhsd,hdr->bhsr", q_nope, w[:, :dn])  # [B, nh, S, R]
    scores = (q_lat @ latent.transpose(-1, -2) + q_rot @ k_rot.transpose(-1, -2)) * scale  # [B, nh, S, C]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")).float(), dim=-1).to(q_nope.dtype)
    return torch.einsum("bhsr,hvr->bhsv", probs @ latent, w[:, dn:])  # [B, nh, S, dv]


def init_kv(
    cfg: LatentAttention,
    mesh: Mesh,
    batch: int,
    max_seq_len: int,
    dtype: torch.dtype,
    device: Any = None,
    *,
    plan: Plan,
) -> list[KV]:
    """A zeroed latent cache: per layer ``(c [batch, 1, max_seq_len, R], k_rot [batch, 1, max_seq_len, dr])``,
    the same on every tp rank (the latent is shared by all heads); with ``plan.mla_cache == "heads"`` this tp
    rank's heads' keys and values."""
    if plan.mla_cache == "heads":  # this rank's heads' keys and values
        nh = local_heads(cfg, mesh.axis_size(plan.tp))
        c = (batch, nh, max_seq_len, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        rot = (batch, nh, max_seq_len, cfg.v_head_dim)
    else:
        c = (batch, 1, max_seq_len, cfg.kv_lora_rank)
        rot = (batch, 1, max_seq_len, cfg.qk_rope_head_dim)
    return [
        (torch.zeros(c, dtype=dtype, device=device), torch.zeros(rot, dtype=dtype, device=device))
        for _ in range(cfg.num_layers)
    ]
