"""Ascend's quantized matmuls as torch ops: what a GE graph calls, with a CPU reference of each.

Each op is a ``torch.library`` custom op with a reference implementation (any device; on CPU the
int8 matmul is ``aten._int_mm``) and a fake kernel, so a model that calls it runs, traces and
compiles anywhere. Under torchair each becomes one GE op through the converters in
:mod:`functional_npu.runtime.serving.ge_converters`:

- :func:`quant_matmul` (``functional_npu::quant_matmul``) -> ``QuantBatchMatmulV3``: int8
  activations ``[M, K]`` times int8 weights ``[K, N]``, int32 accumulation, then a float32 scale
  per output channel ``[N]`` and per token ``[M]`` (W8A8 with dynamic per-token activations):
  ``y = (x @ w) * scale * pertoken_scale``, in ``dtype``;
- :func:`weight_quant_matmul` (``functional_npu::weight_quant_matmul``) ->
  ``WeightQuantBatchMatmulV2``: 16-bit activations ``[M, K]`` times int8 weights ``[K, N]`` or
  int4 weights packed eight to an int32 word along ``N`` (``[K, N / 8]``), dequantized as
  ``(w + offset) * scale`` with a scale (and offset) per output channel ``[N]`` or per group of
  ``group_size`` inputs ``[K / group_size, N]``.

The weights are input-major (``[K, N]``), as Ascend's kernels and torch-npu's packing
(``npu_convert_weight_to_int4pack``) take them; int4 values are two's complement, least significant
nibble first. :func:`pack_int4` and :func:`unpack_int4` convert to and from int8 values.

On the NPU outside torchair's GE graph (npugraph_ex's ACL graph capture, eager) each op runs torch-npu's aclnn op of
the same kernel (:data:`NPU_KERNELS`; their ``PrivateUse1`` kernels): the reference would run ``aten._int_mm``,
which torch-npu has no kernel for, and a chain of casts where capture takes one op.
"""

from __future__ import annotations

import torch

from ..core.quant import pack_int32, unpack_int32

__all__ = [
    "quant_matmul",
    "weight_quant_matmul",
    "quant_matmul_npu",
    "weight_quant_matmul_npu",
    "pack_int4",
    "unpack_int4",
    "CONVERTED",
    "NPU_KERNELS",
    "SCALAR_TYPE",
]

# the ops :mod:`functional_npu.runtime.serving.ge_converters` gives GE converters, as FX graphs name them
CONVERTED = (
    "functional_npu.quant_matmul.default",
    "functional_npu.weight_quant_matmul.default",
    "functional_npu.broadcast_into.default",  # through ge_converters.reinplace_ring, as functional_npu.ring_write
)

# each op's NPU kernel: the torch-npu op (``torch.ops.npu``) it calls, aclnn in torch-npu's own table
NPU_KERNELS = {
    "functional_npu::quant_matmul": "npu_quant_matmul",
    "functional_npu::weight_quant_matmul": "npu_weight_quant_batchmatmul",
}
# torch's ScalarType numbers, which torch-npu's ops take for an output dtype (its TORCH_DTYPE_ENUM_VALUE map)
SCALAR_TYPE = {torch.float16: 5, torch.float32: 6, torch.bfloat16: 15}

_TWOS = -0x77777778  # 0x88888888 as int32: compressed-tensors' nibble ``q + 8`` xor 8 is ``q``'s two's complement


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in ``[-8, 7]`` ``[..., N]`` -> int32 words ``[..., N / 8]``, two's complement nibbles,
    least significant first (Ascend's int4 packing)."""
    return pack_int32(q, 4, -1) ^ _TWOS


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: int8 values ``[..., 8 * n]``."""
    return unpack_int32(words ^ _TWOS, 4, -1)


@torch.library.custom_op("functional_npu::quant_matmul", mutates_args=())
def quant_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pertoken_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """int8 ``x [M, K]`` times int8 ``weight [K, N]`` with int32 accumulation, times float32 ``scale [N]`` and
    ``pertoken_scale [M]``, as ``dtype`` (GE: ``QuantBatchMatmulV3``)."""
    acc = torch.ops.aten._int_mm(x, weight)
    return (acc.float() * scale.float() * pertoken_scale.float()[:, None]).to(dtype)


@quant_matmul.register_fake
def _(x, weight, scale, pertoken_scale, dtype):  # noqa: ANN001, ANN202 - the op's signature
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=dtype)


@torch.library.custom_op("functional_npu::weight_quant_matmul", mutates_args=())
def weight_quant_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """``x [M, K]`` (bf16 / fp16) times ``weight`` (int8 ``[K, N]``, or int4 words ``[K, N / 8]``) dequantized
    as ``(w + offset) * scale``; ``scale`` / ``offset``: ``[N]`` (``group_size`` 0) or ``[K / group_size, N]``
    in ``x``'s dtype (GE: ``WeightQuantBatchMatmulV2``)."""
    q = unpack_int4(weight) if weight.dtype == torch.int32 else weight
    w = q.to(scale.dtype)
    if group_size:
        scale = scale.repeat_interleave(group_size, 0)
        offset = None if offset is None else offset.repeat_interleave(group_size, 0)
    if offset is not None:
        w = w + offset
    return x @ (w * scale).to(x.dtype)


@weight_quant_matmul.register_fake
def _(x, weight, scale, offset, group_size):  # noqa: ANN001, ANN202 - the op's signature
    return x.new_empty((x.shape[0], scale.shape[-1]))


def quant_matmul_npu(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pertoken_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`quant_matmul` on the NPU: torch-npu's ``npu_quant_matmul`` (aclnn ``QuantBatchMatmulV3``), a float32
    scale per output channel and per token."""
    return torch.ops.npu.npu_quant_matmul(
        x, weight, scale.float(), pertoken_scale=pertoken_scale.float(), output_dtype=SCALAR_TYPE[dtype]
    )


def weight_quant_matmul_npu(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """:func:`weight_quant_matmul` on the NPU: torch-npu's ``npu_weight_quant_batchmatmul`` (aclnn
    ``WeightQuantBatchMatmulV2``): ``(w + offset) * scale`` per channel or per group of ``group_size`` inputs; int4
    weights as its packing, eight to an int32 word along ``N``."""
    return torch.ops.npu.npu_weight_quant_batchmatmul(
        x, weight, scale, antiquant_offset=offset, antiquant_group_size=group_size
    )


torch.library.impl("functional_npu::quant_matmul", "PrivateUse1", quant_matmul_npu)
torch.library.impl("functional_npu::weight_quant_matmul", "PrivateUse1", weight_quant_matmul_npu)
