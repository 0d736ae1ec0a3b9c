"""functional-npu: a JAX-style functional layer for model parallelism on torch.compile.

Parameters are pytrees of local shards; each leaf's placement is a :class:`Layout` over a named
:class:`Mesh`; ``shard`` / ``gather`` / ``reshard`` are pure transforms; collectives are explicit functions
over mesh axes that trace whole under ``torch.compile``; a :class:`Plan` holds every parallel choice for
a model (tensor, expert and module parallelism, layer sharding and its prefetch step).

The top level is the core. Namespaces hold the rest:

- :mod:`functional_npu.models`: the model families, their configs and the forward;
- :mod:`functional_npu.interop`: other frameworks' layouts (DTensor placements, Megatron, EP <-> TP);
- :mod:`functional_npu.eplb`: expert-parallel load balancing (redundant experts, rebalancing).
"""

from . import eplb, interop, models
from .core.collectives import all_gather, all_reduce, all_to_all, all_to_all_single, broadcast, permute, reduce_scatter
from .core.layout import Block, Cyclic, Layout, LayoutError, Shard, cyclic, fused, replicated, sharded
from .core.mesh import Mesh, make_mesh
from .core.quant import Quant, dequantize, quant_layouts, quantize
from .core.reshard import RankTraffic, ReshardPlan, Transfer, plan_reshard, reshard
from .core.shard import gather, leaf_specs, local_shape, shard, unshard
from .core.tree import check_structure, flatten_with_paths, map_with_path, tree_from_paths
from .parallel.layer_shard import LayerShard, layer_shard
from .parallel.module_tp import ModuleTP, split_dp
from .parallel.plan import Plan
from .placement.check import check_plan, plan_table
from .runtime.loading.checkpoint import load_checkpoint, read_config
from .runtime.loading.dtensor_state import from_dtensor_state
from .runtime.planning.choose import Workload, choose_plan
from .runtime.serving.compile import CompiledModel, compile_model, greedy_generate

__version__ = "0.1.0"

__all__ = [
    # mesh and layouts
    "Mesh",
    "make_mesh",
    "Layout",
    "LayoutError",
    "Block",
    "Shard",
    "Cyclic",
    "replicated",
    "sharded",
    "fused",
    "cyclic",
    "Quant",
    "quant_layouts",
    "quantize",
    "dequantize",
    # pure transforms over pytrees
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
    "flatten_with_paths",
    "map_with_path",
    "tree_from_paths",
    "check_structure",
    # collectives
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "permute",
    # the parallel plan
    "Plan",
    "choose_plan",
    "Workload",
    "ModuleTP",
    "split_dp",
    "LayerShard",
    "layer_shard",
    "check_plan",
    "plan_table",
    # load, compile, generate
    "load_checkpoint",
    "read_config",
    "from_dtensor_state",
    "compile_model",
    "CompiledModel",
    "greedy_generate",
    # namespaces
    "models",
    "interop",
    "eplb",
]
