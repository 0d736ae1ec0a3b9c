"""functional-npu: a JAX-style functional layer for model parallelism on torch.compile.

Parameters are pytrees of local shards; each leaf's placement is a :class:`Layout` over a named
:class:`Mesh`; ``shard`` / ``gather`` are pure transforms; collectives are explicit functions
over mesh axes that trace whole under ``torch.compile``.
"""

from .core.collectives import all_gather, all_reduce, all_to_all, all_to_all_single, broadcast, permute, reduce_scatter
from .core.dtensor import layout_from_dtensor, mesh_from_device_mesh, placements_of, to_dtensor
from .core.layout import Block, Cyclic, Layout, LayoutError, Shard, cyclic, fused, replicated, sharded
from .core.mesh import Mesh, make_mesh
from .core.quant import Quant, dequantize, quant_layouts, quantize
from .core.reshard import RankTraffic, ReshardPlan, Transfer, plan_reshard, reshard
from .core.shard import gather, leaf_specs, local_shape, shard, unshard
from .core.tree import check_structure, flatten_with_paths, map_with_path, tree_from_paths
from .interop.megatron import (
    MEGATRON_NAMES,
    from_megatron,
    megatron_pipeline_specs,
    megatron_specs,
    stack_layers,
    stacked_specs,
    to_megatron,
    unstack_layers,
)
from .models import Family, MoeConfig, family_of, with_module_tp
from .parallel.ep_tp import ep_to_tp, expert_layouts, tp_to_ep
from .parallel.eplb import (
    Move,
    RankProgram,
    RebalancePlan,
    default_placement,
    plan_rebalance,
    rank_program,
    rebalance,
    routing_table,
    validate_placement,
)
from .parallel.eplb_balance import balanced_placement
from .parallel.module_tp import ModuleTP, split_dp
from .runtime.checkpoint import load_checkpoint, read_config
from .runtime.compile import CompiledModel, compile_model, greedy_generate

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "make_mesh",
    "Layout",
    "LayoutError",
    "Block",
    "Shard",
    "Cyclic",
    "Quant",
    "quant_layouts",
    "quantize",
    "dequantize",
    "replicated",
    "sharded",
    "fused",
    "cyclic",
    "shard",
    "gather",
    "unshard",
    "local_shape",
    "leaf_specs",
    "reshard",
    "plan_reshard",
    "ReshardPlan",
    "Transfer",
    "RankTraffic",
    "layout_from_dtensor",
    "mesh_from_device_mesh",
    "placements_of",
    "to_dtensor",
    "MEGATRON_NAMES",
    "megatron_specs",
    "megatron_pipeline_specs",
    "from_megatron",
    "to_megatron",
    "stack_layers",
    "unstack_layers",
    "stacked_specs",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "permute",
    "compile_model",
    "CompiledModel",
    "load_checkpoint",
    "read_config",
    "greedy_generate",
    "MoeConfig",
    "Family",
    "family_of",
    "with_module_tp",
    "ModuleTP",
    "split_dp",
    "flatten_with_paths",
    "map_with_path",
    "tree_from_paths",
    "check_structure",
    "validate_placement",
    "default_placement",
    "routing_table",
    "plan_rebalance",
    "rank_program",
    "rebalance",
    "RebalancePlan",
    "RankProgram",
    "Move",
    "balanced_placement",
    "expert_layouts",
    "ep_to_tp",
    "tp_to_ep",
]
