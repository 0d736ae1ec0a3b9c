"""The checks a user runs on their own graphs: the prefetch ring's hazard check over a graph's partial order
(:mod:`.hazard`) and the programs it reads from what torch builds (:mod:`.hazard_fx`): a functionalized FX graph,
inductor's generated code, an eager run.

Not imported by ``import functional_npu``: ``from functional_npu.checks import check, from_fx``.
"""

from .hazard import Program, bind, check, expected_slot, input_layout, input_path, read_layers
from .hazard_fx import Recorder, dynamo_inputs, from_fx, from_inductor_code

__all__ = [
    "Program",
    "check",
    "bind",
    "expected_slot",
    "input_layout",
    "input_path",
    "read_layers",
    "from_fx",
    "from_inductor_code",
    "Recorder",
    "dynamo_inputs",
]
