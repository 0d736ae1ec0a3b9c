"""The core: pytrees with dotted paths, the named mesh, layouts as data, the pure transforms over them (shard,
gather, reshard), the collectives over mesh axes, quantized weights as data, DTensor placements, config schemas.

Each module is one concept (docs/architecture.md); this face re-exports their public names. Each collective's
backward rule (:mod:`.collective_grads`) is the collectives' own, not re-exported.
"""

from .agree import agree
from .buckets import least_bucket
from .cache_dir import cache_dir
from .collectives import (
    BROADCAST_INTO,
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    broadcast_into,
    copy_into,
    permute,
    reduce_scatter,
)
from .dtensor import layout_from_dtensor, layout_from_placements, mesh_from_device_mesh, placements_of, to_dtensor
from .layout import Block, Cyclic, Layout, LayoutError, Shard, cyclic, fused, replicated, sharded
from .mesh import Mesh, make_mesh
from .params import Params, drop
from .quant import Quant, dequantize, quant_layouts, quantize
from .reshard import ReshardPlan, pack, plan_reshard, reshard, simulate
from .schema import read, show
from .shard import gather, leaf_specs, local_shape, shard, unshard
from .tree import check_structure, flatten_with_paths, map_with_path, tree_from_paths

__all__ = [
    "agree",
    "cache_dir",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_into",
    "copy_into",
    "permute",
    "BROADCAST_INTO",
    "mesh_from_device_mesh",
    "layout_from_placements",
    "layout_from_dtensor",
    "placements_of",
    "to_dtensor",
    "Block",
    "Shard",
    "Cyclic",
    "Layout",
    "LayoutError",
    "replicated",
    "sharded",
    "fused",
    "cyclic",
    "Mesh",
    "make_mesh",
    "Quant",
    "quant_layouts",
    "quantize",
    "dequantize",
    "ReshardPlan",
    "plan_reshard",
    "reshard",
    "pack",
    "simulate",
    "least_bucket",
    "read",
    "show",
    "shard",
    "local_shape",
    "gather",
    "unshard",
    "leaf_specs",
    "Params",
    "drop",
    "flatten_with_paths",
    "map_with_path",
    "tree_from_paths",
    "check_structure",
]
