"""Grouped-query attention with rotary embeddings and a static KV cache, tensor-parallel over heads.

``qkv`` is column-parallel with fused blocks ``[q | k | v]`` (KV heads replicated when tp exceeds
their count), ``o_proj`` row-parallel followed by an all_reduce. The KV cache is donated: each call
writes its keys and values in place at the query positions. ``kind`` picks how the scores are
computed: ``"sdpa"`` (``scaled_dot_product_attention``) or ``"math"`` (matmul + softmax, every op of
which has a GE converter: the torchair path).

What every layer shares in one step (rotary cos / sin, the mask, the cache slots) is computed once
by :func:`prepare` before the layer loop.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from ..core.collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from ..core.mesh import Mesh
from .invariant_modes import ops as invariant_ops_of
from .linear import int8_activations, linear, row_parallel, token_amax
from .norm import rms_norm
from .paged import PagedKV, indices, paged

__all__ = [
    "Rotary",
    "GroupedQuery",
    "ATTENTION_KINDS",
    "Step",
    "local_heads",
    "inv_freq",
    "rope",
    "rotate",
    "attention_mask",
    "attend",
    "grouped",
    "grouped_scores",
    "split_heads",
    "merge_heads",
    "prepare",
    "gqa",
    "store",
    "output_projection",
    "init_kv",
]


class Rotary(Protocol):
    """The config fields a layer's rotary embedding and mask read (``prepare``)."""

    head_dim: int
    rope_theta: float
    rope_type: str  # "default", "linear" or "llama3"
    rope_factor: float
    sliding_window: int | None


class GroupedQuery(Rotary, Protocol):
    """The config fields grouped-query attention reads (any family that runs it)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope_low_freq_factor: float  # llama3 rope only, with the next two
    rope_high_freq_factor: float
    rope_original_max_positions: int


ATTENTION_KINDS = ("sdpa", "math")
GQA_DEVICES = ("cpu", "cuda")  # where SDPA takes grouped KV heads as they are (enable_gqa)
GROUPED_SCORE_BYTES = 32 << 20  # the most float32 scores grouped() materializes for one call (grouped_scores)
KV = tuple[torch.Tensor, torch.Tensor]


class Step(NamedTuple):
    """What every attention layer of one step shares: rotary ``cos``/``sin`` ``[B, 1, S, hd]``, the
    mask ``[B, 1, S, C]`` and the cache slots the new keys go to ``[B, kv heads, S, hd]``.

    ``gather``: the queries attend over ``[cache | this step's keys]`` (mask ``[B, 1, S, C + S]``) and the new
    cache is that gathered at ``slot [B, kv heads, C, hd]`` (a sliding window's ring filled by a prefill:
    :mod:`functional_npu.models.ring`)."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor
    slot: torch.Tensor | None
    gather: bool = False
    read: torch.Tensor | None = None  # a paged cache's flat pool rows (models.paged.indices): every position's
    write: torch.Tensor | None = None  # and this step's


def local_heads(cfg: GroupedQuery, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) on one tp rank; a KV head is replicated when tp > num_kv_heads."""
    return cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp)


def inv_freq(cfg: Rotary) -> torch.Tensor:
    """Rotary inverse frequencies ``[hd / 2]`` with the config's scaling (default, linear, llama3)."""
    hd = cfg.head_dim
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if cfg.rope_type == "linear":
        return freq / cfg.rope_factor
    if cfg.rope_type == "llama3":
        old, lo, hi, factor = (
            cfg.rope_original_max_positions,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_factor,
        )
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old / lo, freq / factor, freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    return freq


def rope(
    positions: torch.Tensor, cfg: Rotary, dtype: torch.dtype, invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) ``[B, 1, S, hd]`` for ``positions [B, S]``; ``invariant``: by :func:`~.invariant.sin_cos`."""
    freqs = positions[..., None].float() * inv_freq(cfg).to(positions.device)  # [B, S, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, S, hd]
    if invariant:
        sin, cos = invariant_ops_of(invariant).sin_cos(emb)
        return cos.to(dtype), sin.to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply the rotary embedding to ``x [B, heads, S, hd]`` (the half-split convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attention_mask(positions: torch.Tensor, cache_len: int, window: int | None) -> torch.Tensor:
    """[B, 1, S, cache_len] boolean: a query at position p sees keys at positions <= p (and > p - window)."""
    kv = torch.arange(cache_len, device=positions.device)
    q = positions[:, None, :, None]
    mask = kv <= q
    if window is not None:
        mask = mask & (kv > q - window)
    return mask


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "sdpa",
    scale: float | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """Masked attention ``[B, H, S, dv]``: SDPA, or ``"math"`` (matmul + softmax: every op has a GE converter).
    ``scale``: of the scores (default ``hd ** -0.5``); ``groups``: query heads per KV head (grouped-query attention:
    ``keys`` and ``values`` hold ``H / groups`` heads). On the CPU and CUDA, SDPA reads each KV head for its group of
    query heads (``enable_gqa``); elsewhere, and with ``"math"``, the KV heads are repeated first (at batch 32 on the
    CPU the repeated copies took 2 ms a layer, SDPA over the grouped heads 0.3 ms). 16-bit ``"sdpa"`` on the CPU
    takes :func:`grouped` where its scores are small (:func:`grouped_scores`)."""
    if kind == "sdpa" and grouped_scores(q, keys):
        return grouped(q, keys, values, mask, scale)
    if kind == "sdpa" and groups > 1 and q.device.type in GQA_DEVICES:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    if groups > 1:
        keys, values = (c.repeat_interleave(groups, dim=1) for c in (keys, values))
    if kind == "sdpa":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    if kind != "math":
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {kind!r}")
    scores = (q @ keys.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # [B, H, S, C]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values


def grouped_scores(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether ``"sdpa"`` attention takes :func:`grouped` instead: 16-bit queries on the CPU whose float32 scores
    fit :data:`GROUPED_SCORE_BYTES` (decode steps and short prefills). There torch's SDPA (its CPU flash kernel)
    runs 16-bit inputs 2-9x slower than a matmul and a softmax over the same shapes: at batch 32, 8 query heads
    over 4 KV heads of 64, one query, bf16 and 2 threads, 1.12 ms against 0.16 ms at 64 cached positions and 15.8
    against 1.8 ms at 1024 (``benchmarks/README.md``); in float32 the two run alike, and SDPA is kept."""
    b, h, s, _ = q.shape
    fits = b * h * s * keys.shape[2] * 4 <= GROUPED_SCORE_BYTES
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and fits


def grouped(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Masked attention ``[B, H, S, dv]`` as two batched matmuls and a float32 softmax, each KV head's group of
    query heads stacked as one matrix: ``q [B, H, S, hd]`` over ``keys`` / ``values`` ``[B, H / g, C, hd | dv]``,
    ``mask [B, 1, S, C]``; query head ``i`` reads KV head ``i // g``, as SDPA's ``enable_gqa``. The scores are
    the 16-bit matmul's (accumulated in float32, rounded once), then scaled, masked and normalized in float32,
    as transformers' eager attention."""
    b, h, s, hd = q.shape
    nkv, c = keys.shape[1], keys.shape[2]
    g = h // nkv
    scores = (q.reshape(b, nkv, g * s, hd) @ keys.transpose(-1, -2)).float()  # [B, nkv, g S, C]
    scores = scores.view(b, nkv, g, s, c) * (hd**-0.5 if scale is None else scale)
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(q.dtype).view(b, nkv, g * s, c)
    return (weights @ values).view(b, h, s, values.shape[-1])


def split_heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[B, S, H * hd] -> [B, H, S, hd]`` (a view: reshape, then permute). Written out rather than as an einops
    pattern: dynamo traces an einops call through its recipe machinery, about 0.15 s a call on this machine, four
    calls a layer and graph; these two ops trace in a few milliseconds and give the same aten graph."""
    b, s, w = t.shape
    return t.reshape(b, s, w // head_dim, head_dim).permute(0, 2, 1, 3)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, hd] -> [B, S, H * hd]`` (permute, then reshape), the inverse of :func:`split_heads`."""
    b, h, s, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, s, h * d)


def prepare(cfg: Rotary, positions: torch.Tensor, kv: KV, dtype: torch.dtype, invariant: bool = False) -> Step:
    """The per-step values every layer shares, for ``positions [B, S]`` and a layer's cache ``kv`` (contiguous, or a
    :class:`~functional_npu.models.paged.PagedKV`)."""
    b, s = positions.shape
    cos, sin = rope(positions, cfg, dtype, invariant)
    if isinstance(kv, PagedKV):
        read, write = indices(kv.table, positions, kv.k.shape[1])
        mask = attention_mask(positions, read.shape[1], cfg.sliding_window)
        return Step(cos, sin, mask, None, read=read, write=write)
    mask = attention_mask(positions, kv[0].shape[2], cfg.sliding_window)
    slot = positions[:, None, :, None].expand(b, kv[0].shape[1], s, cfg.head_dim)
    return Step(cos, sin, mask, slot)


def gqa(
    layer: dict,
    h: torch.Tensor,
    step: Step,
    kv: KV,
    mesh: Mesh,
    *,
    cfg: GroupedQuery,
    tp: str,
    kind: str,
    axes: tuple[str, ...] = (),
    scale: float | None = None,
    norm_offset: float = 0.0,
    invariant: bool = False,
) -> torch.Tensor:
    """``h [B, S, D]`` (normed) -> the residual update ``[B, S, D]``; writes this step's keys and values into ``kv``.

    Heads are split over ``tp``; ``axes``: o_proj's module-TP group (data-parallel axes); ``scale``: of the scores
    (default ``head_dim ** -0.5``); ``norm_offset``: the q / k norms' (:func:`rms_norm`'s); ``invariant``: every
    reduction in one fixed order (:mod:`~functional_npu.models.invariant`; ``kind`` is then not read).
    """
    hd = cfg.head_dim
    nh, nkv = local_heads(cfg, mesh.axis_size(tp))
    kern = invariant_ops_of(invariant) if invariant else None
    norm = kern.rms_norm if invariant else rms_norm
    qkv = (kern.linear if invariant else linear)(h, layer["qkv"])  # column-parallel: [B, S, (nh + 2 nkv) hd]
    if "qkv_bias" in layer:
        qkv = qkv + layer["qkv_bias"]
    q, k, v = [split_heads(t, hd) for t in qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)]
    if "q_norm" in layer:
        q = norm(q, layer["q_norm"], cfg.rms_norm_eps, norm_offset)
        k = norm(k, layer["k_norm"], cfg.rms_norm_eps, norm_offset)
    q, k = rotate(q, step.cos, step.sin), rotate(k, step.cos, step.sin)
    keys, values = store(kv, k, v, step)
    if invariant:
        out = kern.attend(q, keys, values, step.mask, scale, nh // nkv)
        return kern.row_parallel(merge_heads(out), layer["o_proj"], mesh, tp)
    attn = merge_heads(attend(q, keys, values, step.mask, kind, scale, nh // nkv))
    return output_projection(attn, layer["o_proj"], mesh, tp=tp, axes=axes)


def store(kv: KV, k: torch.Tensor, v: torch.Tensor, step: Step) -> KV:
    """Write this step's keys and values ``[B, kv heads, S, hd]`` into the cache ``kv`` (in place); returns what
    the queries attend over: the cache, or (``step.gather``) ``[cache as it was | k, v]``, or for a paged cache
    (``step.write``) the pool gathered at ``step.read``, ``[B, kv heads, C, hd]``."""
    if step.write is not None:
        return paged(kv[0], k, step.write, step.read), paged(kv[1], v, step.write, step.read)
    if not step.gather:
        kv[0].scatter_(2, step.slot, k)
        kv[1].scatter_(2, step.slot, v)
        return kv
    keys, values = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)
    kv[0].copy_(keys.gather(2, step.slot))
    kv[1].copy_(values.gather(2, step.slot))
    return keys, values


def output_projection(attn: torch.Tensor, w: Any, mesh: Mesh, *, tp: str, axes: tuple[str, ...] = ()) -> torch.Tensor:
    """o_proj: ``attn [B, S, H hd / tp]`` (this rank's heads) -> ``[B, S, D]``, row-parallel over ``tp``.

    With module TP over data-parallel ``axes`` (``n`` ranks; o_proj's input dim cut over ``axes + (tp,)``,
    block ``j * tp + t`` at group index ``j``, tp index ``t``): every head of this rank's rows is gathered
    over tp, each group rank is sent its block of them (all_to_all), multiplies the group's ``n B`` rows,
    and the partial sums go back to their rows' rank (reduce_scatter), then are summed over tp.
    """
    n = mesh.axis_size(axes)
    if n == 1:
        return row_parallel(attn, w, mesh, tp)
    full = all_gather(attn, mesh, tp, dim=-1)  # [B, S, H hd]
    t, nt = mesh.axis_index(tp), mesh.axis_size(tp)
    b, s, width = full.shape
    # "b s (j t w) -> t j b s w", taken at t: block j * tp + t goes to j
    send = full.reshape(b, s, n, nt, width // (n * nt)).permute(3, 2, 0, 1, 4)[t].contiguous()
    rows = all_to_all(send, mesh, axes).flatten(0, 1)  # [(j b), s, w]: the group's rows, this rank's block
    amax = all_gather(token_amax(full), mesh, axes) if int8_activations(w) else None  # W8A8: whole-row scales
    y = linear(rows, w, amax=amax)  # [n B, S, D], partial over the blocks
    return all_reduce(reduce_scatter(y, mesh, axes), mesh, tp)


def init_kv(
    cfg: GroupedQuery, mesh: Mesh, batch: int, max_seq_len: int, dtype: torch.dtype, device: Any = None, *, tp: str
) -> list[KV]:
    """A zeroed static KV cache on ``device``: per layer ``(k, v)`` of shape ``[batch, local KV heads, max_seq_len,
    head_dim]``."""
    _, kv = local_heads(cfg, mesh.axis_size(tp))
    shape = (batch, kv, max_seq_len, cfg.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_layers)
    ]
