"""RMSNorm, the one normalization the supported families use, and tanh soft-capping."""

from __future__ import annotations

import torch

__all__ = ["rms_norm", "softcap"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim, computed in the wider of float32 and ``x``'s dtype (float64 stays
    float64) and returned in ``x``'s dtype.

    ``offset``: the weight is stored as a deviation from it (Gemma: 1, the scale is ``1 + weight``); the scale
    is then applied in that precision, before the cast, as Gemma's norm does."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if offset:
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.to(xf.dtype))).to(x.dtype)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(x / cap) * cap``: ``x`` squashed into ``(-cap, cap)`` (Gemma's logit soft-capping)."""
    return torch.tanh(x / cap) * cap
