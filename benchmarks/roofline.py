"""The roofline of one decode step, on any device: ``max(bytes / read bandwidth, FLOPs / matmul peak)``.

A decode step at batch ``b`` reads every weight once (the embedding table excepted, of which one row per token) and
each sequence's KV cache, and does 2 FLOPs per weight parameter and token plus attention's. Both terms are measured
in the same run as the figure they bound (a streaming read and a large matrix product, sampled between rounds);
the larger one is the least time the step can take, and the term that binds is named with it.
"""

from __future__ import annotations

from typing import Any

from functional_npu.core import flatten_with_paths
from functional_npu.models.llama import abstract_params

__all__ = ["step_cost", "step_floor", "weight_count"]


def weight_count(cfg: Any) -> int:
    """The weight parameters one token multiplies: all but the embedding table (a lookup, not a product)."""
    return sum(x.numel() for p, x in flatten_with_paths(abstract_params(cfg)) if p != "embed")


def step_cost(cfg: Any, weight_bytes: int, kv_elem: int, b: int, prompt: int, new: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step at batch ``b`` after a ``prompt``-token prompt, at the mean context of ``new``
    new tokens: the weights once (``weight_bytes``, as held: quantized formats hold fewer) and each sequence's KV
    cache of ``kv_elem``-byte values; 2 FLOPs per weight parameter and token (:func:`weight_count`, whatever the
    format stores) and attention's ``4 * layers * heads * head_dim * context`` per token."""
    ctx = prompt + new / 2
    kv = b * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * ctx * kv_elem
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx
    return weight_bytes + kv, b * (2 * weight_count(cfg) + attn)


def step_floor(nbytes: float, flops: float, read: float, peak: float) -> tuple[float, str]:
    """The least time one decode step can take, and the term that binds: ``max(bytes / read, FLOPs / peak)``."""
    memory, compute = nbytes / read, flops / peak
    return (memory, "memory") if memory >= compute else (compute, "compute")
