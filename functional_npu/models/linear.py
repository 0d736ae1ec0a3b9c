"""A linear layer's matmul, chosen by what its weight leaf holds.

- a float tensor ``[out, in]``: ``x @ w.T``;
- a quantized weight prepared for the CPU kernels by :func:`prepare` (a dict; its keys name the form):

  - ``{"w8", "scale"}``: int8 weights with a scale per output channel, ``aten._weight_int8pack_mm``;
  - ``{"w4", "scales_zeros"}``: int4 weights with a scale (and zero) per group of inputs, in the
    kernel's own packing, ``aten._weight_int4pack_mm_for_cpu``;
  - ``{"w8a8", "scale"}``: int8 weights and int8 activations quantized per token as they arrive
    (W8A8), ``aten._int_mm`` with int32 accumulation, then both scales.

The stored form (:mod:`functional_npu.core.quant`: ``weight``, ``weight_scale``, ...) is what
layouts, loaders and resharding see; :func:`prepare` turns one local shard of it into a kernel's
form, once, after loading. The kernels take activations and scales in one dtype (bf16 is their fast
path on CPU; fp32 activations run far slower), so :func:`prepare` casts the scales to the dtype the
model computes in. A scheme no kernel covers (int8 group or block scales, int4 groups the kernel
does not take, output sizes it does not tile) is dequantized to a dense weight in that dtype:
correct, and as slow as a float model.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.quant import Quant, dequantize, unpack_int32

__all__ = ["linear", "prepare", "kernel_of"]

_INT4_GROUPS = (32, 64, 128, 256)  # what aten._weight_int4pack_mm_for_cpu takes
_INT4_TILE = 16  # it needs out_features divisible by this


def kernel_of(w: Any) -> str:
    """The form of a weight leaf: ``"dense"``, ``"w8"``, ``"w4"`` or ``"w8a8"``."""
    if isinstance(w, torch.Tensor):
        return "dense"
    for kind in ("w8", "w4", "w8a8"):
        if kind in w:
            return kind
    raise TypeError(
        f"a linear weight is a tensor or a prepared quantized weight (keys w8 / w4 / w8a8), got keys {sorted(w)}; "
        f"stored quantized weights go through functional_npu.models.linear.prepare first"
    )


def linear(x: torch.Tensor, w: Any) -> torch.Tensor:
    """``x [..., in]`` times the weight ``[out, in]`` transposed: ``[..., out]``."""
    kind = kernel_of(w)
    if kind == "dense":
        return x @ w.T
    flat = x.reshape(-1, x.shape[-1])
    if kind == "w8":
        y = torch.ops.aten._weight_int8pack_mm(flat, w["w8"], w["scale"])
    elif kind == "w4":
        group = x.shape[-1] // w["scales_zeros"].shape[0]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, w["w4"], group, w["scales_zeros"])
    else:  # W8A8: symmetric int8 per token (compressed-tensors' rule: absmax / 127.5), int32 accumulation
        amax = flat.abs().amax(-1, keepdim=True).float().clamp(min=torch.finfo(torch.float32).eps)
        x_scale = amax / 127.5
        xq = torch.clamp(torch.round(flat.float() / x_scale), -128, 127).to(torch.int8)
        acc = torch.ops.aten._int_mm(xq, w["w8a8"].T)
        y = (acc.float() * x_scale * w["scale"].float()).to(x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def prepare(stored: dict[str, torch.Tensor], quant: Quant, dtype: torch.dtype) -> Any:
    """A kernel's form of one quantized weight (this rank's shard, as stored), for activations in ``dtype``;
    a dense ``dtype`` weight where no kernel covers the scheme (see the module docstring)."""
    out_features = stored["weight"].shape[-2]
    if quant.bits == 8 and quant.strategy == "channel" and quant.symmetric:
        w8 = (unpack_int32(stored["weight"], 8, -1) if quant.packed else stored["weight"]).contiguous()
        if quant.activations == "token":
            return {"w8a8": w8, "scale": stored["weight_scale"].reshape(-1).float()}
        return {"w8": w8, "scale": stored["weight_scale"].reshape(-1).to(dtype)}
    if quant.bits == 4 and quant.strategy in ("group", "channel") and out_features % _INT4_TILE == 0:
        in_features = stored["weight"].shape[-1] * quant.pack
        group = quant.group_size if quant.strategy == "group" else _channel_group(in_features)
        if group in _INT4_GROUPS and in_features % group == 0:
            return _int4(stored, quant, group, in_features, dtype)
    return dequantize(stored, quant).to(dtype)


def _channel_group(in_features: int) -> int | None:
    """A kernel group size for per-channel int4 scales (each channel's scale repeated over its groups)."""
    return next((g for g in reversed(_INT4_GROUPS) if in_features % g == 0), None)


def _int4(stored: dict[str, torch.Tensor], quant: Quant, group: int, in_features: int, dtype: torch.dtype) -> dict:
    """int4 weights in ``aten._weight_int4pack_mm_for_cpu``'s packing (built by its own op: the byte layout
    depends on the CPU), with ``scales_zeros [in / group, out, 2]``: ``w = (u - 8) * scale + zero``, so an
    asymmetric zero point ``zp`` becomes ``zero = -zp * scale``."""
    unsigned = (unpack_int32(stored["weight"], 4, -1).to(torch.int32) + 8).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 2)
    scale = stored["weight_scale"].float()  # [out, in / G], or [out, 1] per channel
    per = in_features // group // scale.shape[-1]  # kernel groups per stored scale
    scale = scale.repeat_interleave(per, -1)
    zero = torch.zeros_like(scale)
    if not quant.symmetric:
        zp = unpack_int32(stored["weight_zero_point"], 4, -2).float().repeat_interleave(per, -1)
        zero = -zp * scale
    scales_zeros = torch.stack([scale.T, zero.T], -1).to(dtype).contiguous()
    return {"w4": packed, "scales_zeros": scales_zeros}
