"""Other frameworks' layouts as this library's: DTensor placements and device meshes, Megatron's training
layout (tensor, pipeline and virtual pipeline parallelism), and experts between expert- and tensor-parallel
layouts (a training EP layout to an inference TP one)."""

from ..parallel.ep_tp import ep_to_tp, expert_layouts, tp_to_ep
from .megatron import (
    from_megatron,
    megatron_pipeline_specs,
    megatron_specs,
    stack_layers,
    stacked_specs,
    to_megatron,
    unstack_layers,
)
from .torch_dtensor import layout_from_dtensor, mesh_from_device_mesh, placements_of, to_dtensor

__all__ = [
    "layout_from_dtensor",
    "mesh_from_device_mesh",
    "placements_of",
    "to_dtensor",
    "megatron_specs",
    "megatron_pipeline_specs",
    "from_megatron",
    "to_megatron",
    "stack_layers",
    "unstack_layers",
    "stacked_specs",
    "expert_layouts",
    "ep_to_tp",
    "tp_to_ep",
]
