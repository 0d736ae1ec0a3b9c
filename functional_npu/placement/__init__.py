"""Where every piece of a model lives: a plan checked against a model config and a mesh, once.

- :mod:`.check`: does a plan fit a model and a mesh (``check_plan``), a params tree's shapes against it
  (``check_params``), the leaf table (``plan_table``);
- :mod:`.quant_config`: a checkpoint's compressed-tensors ``quantization_config``, read and written;
- :mod:`.quant_layouts`: the linear leaves a quantization scheme covers, as the dicts of their stored tensors with
  their layouts.
"""

from .check import check_params, check_plan, check_plan_fits, plan_table, resolved
from .hf_layout import stored_tensors
from .quant_config import PRESETS, QuantConfig, read_quant_config
from .quant_layouts import quantize_plan, quantized_leaves, tensor_blocks

__all__ = [
    "check_plan",
    "check_plan_fits",
    "check_params",
    "plan_table",
    "resolved",
    "QuantConfig",
    "PRESETS",
    "read_quant_config",
    "quantize_plan",
    "quantized_leaves",
    "tensor_blocks",
    "stored_tensors",
]
