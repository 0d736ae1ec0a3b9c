"""torchair converters for :mod:`functional_npu.models.ascend_ops`: each op becomes Ascend's own GE op.

Importing this module registers them (torchair's ``register_fx_node_ge_converter``), so import it
only where ``torchair`` imports: :mod:`functional_npu.runtime.backends` does before it hands torchair
a graph, and so does the CPU conversion process of ``python -m tools.graphs``.

- ``functional_npu::quant_matmul`` -> ``QuantBatchMatmulV3(x1 int8, x2 int8, scale, pertoken_scale)``
  with the output dtype as its ``dtype`` attribute;
- ``functional_npu::weight_quant_matmul`` -> ``WeightQuantBatchMatmulV2(x, weight, antiquant_scale,
  antiquant_offset, antiquant_group_size)``; packed int4 words are bitcast to ``DT_INT4`` and
  reshaped to ``[K, N]`` first (the op reads a ``DT_INT4`` weight, as torchair's own converter for
  torch-npu's ``npu_quant_matmul`` does for int4).
"""

from __future__ import annotations

from typing import Any

import torch
from torchair import register_fx_node_ge_converter  # type: ignore[import-not-found]
from torchair._ge_concrete_graph import ge_apis as ge  # type: ignore[import-not-found]
from torchair.ge import DataType  # type: ignore[import-not-found]
from torchair.ge._ge_graph import _ge_dtype_to_ge_proto_dtype, torch_type_to_ge_type  # type: ignore[import-not-found]

from ..models import ascend_ops  # noqa: F401 - defines the ops converted here

__all__: list[str] = []


@register_fx_node_ge_converter(torch.ops.functional_npu.quant_matmul.default)
def _quant_matmul(
    x: Any, weight: Any, scale: Any, pertoken_scale: Any, dtype: torch.dtype, meta_outputs: Any = None
) -> Any:
    return ge.QuantBatchMatmulV3(
        x,
        weight,
        scale,
        offset=None,
        bias=None,
        pertoken_scale=pertoken_scale,
        dtype=torch_type_to_ge_type(dtype),
        transpose_x1=False,
        transpose_x2=False,
    )


@register_fx_node_ge_converter(torch.ops.functional_npu.weight_quant_matmul.default)
def _weight_quant_matmul(
    x: Any, weight: Any, scale: Any, offset: Any, group_size: int, meta_outputs: Any = None
) -> Any:
    if weight.dtype == DataType.DT_INT32:  # [K, N / 8] words -> [K, N] int4
        k, words = weight.symsize
        shape = ge.Const([k, words * 8], dtype=DataType.DT_INT64)
        weight = ge.Reshape(ge.Bitcast(weight, type=DataType.DT_INT4), shape)
        weight.desc.dtype = _ge_dtype_to_ge_proto_dtype(DataType.DT_INT4)  # what GE would infer, stated
    return ge.WeightQuantBatchMatmulV2(
        x,
        weight,
        scale,
        antiquant_offset=offset,
        quant_scale=None,
        quant_offset=None,
        bias=None,
        transpose_x=False,
        transpose_weight=False,
        antiquant_group_size=group_size,
    )
