"""Where every piece of a model lives: a plan checked against a model config and a mesh, once.

- :mod:`.placement`: the :class:`Placement` (``place``, cached): the resolved plan, the mesh's axes, the abstract
  params and every leaf's layout, carried from load to compile; ``check_plan``, ``plan_table``, plan files;
- :mod:`.check`: the checks a placement is made of (a plan's fields against the model and the mesh, every leaf at
  every coordinate), the leaf table;
- :mod:`.hf_layout`: each leaf's tensors in a Hugging Face checkpoint and how they are cut;
- :mod:`.quant_config`: a checkpoint's compressed-tensors ``quantization_config``, read and written;
- :mod:`.ring_memory`: whether layer sharding saves memory: a rank's owned layers plus its prefetch ring against the
  series replicated (:func:`ring_memory`), and the one warning when it does not (:class:`RingMemoryWarning`);
- :mod:`.quant_layouts`: the linear leaves a quantization scheme covers, as the dicts of their stored tensors with
  their layouts.
"""

from .check import check_plan_fits, resolved
from .hf_layout import stored_tensors
from .placement import Placement, builds, check_plan, place, placement_of, plan_table, read_placement
from .quant_config import QuantConfig
from .quant_layouts import quantize_plan
from .ring_memory import RingMemory, RingMemoryWarning, ring_memory

__all__ = [
    "check_plan",
    "check_plan_fits",
    "Placement",
    "place",
    "placement_of",
    "read_placement",
    "builds",
    "plan_table",
    "resolved",
    "QuantConfig",
    "quantize_plan",
    "stored_tensors",
    "ring_memory",
    "RingMemory",
    "RingMemoryWarning",
]
