"""functional-npu: a JAX-style functional layer for model parallelism on torch.compile.

Parameters are pytrees of local shards; each leaf's placement is a :class:`Layout` over a named
:class:`Mesh`; ``shard`` / ``gather`` / ``reshard`` are pure transforms; collectives are explicit functions
over mesh axes that trace whole under ``torch.compile``; a :class:`Plan` holds every parallel choice for
a model (tensor, expert and module parallelism, layer sharding and its prefetch step).

The top level is the core, the plan and its placement, and the entry points to load, compile, generate and train.
Namespaces hold the rest:

- :mod:`functional_npu.models`: the model families, their configs and the forward;
- :mod:`functional_npu.interop`: other frameworks' layouts (DTensor placements, Megatron, EP <-> TP);
- :mod:`functional_npu.eplb`: expert-parallel load balancing (redundant experts, rebalancing).
"""

from . import eplb, interop, models
from .core import (
    Block,
    Cyclic,
    Layout,
    LayoutError,
    Mesh,
    Params,
    Quant,
    ReshardPlan,
    Shard,
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    check_structure,
    cyclic,
    dequantize,
    flatten_with_paths,
    fused,
    gather,
    leaf_specs,
    local_shape,
    make_mesh,
    map_with_path,
    permute,
    plan_reshard,
    quant_layouts,
    quantize,
    reduce_scatter,
    replicated,
    reshard,
    shard,
    sharded,
    tree_from_paths,
    unshard,
)
from .parallel import LayerShard, ModuleTP, Plan, layer_shard, split_dp
from .placement import Placement, check_plan, place, plan_table, read_placement
from .runtime.loading import from_dtensor_state, load_checkpoint, read_config, save_checkpoint
from .runtime.planning import Workload, choose_plan
from .runtime.serving import CompiledModel, CompileOptions, compile_model, greedy_generate
from .runtime.training import AdamW, compile_train_step, lm_loss, reshard_params, token_logprobs, value_and_grad

__version__ = "0.1.0"

__all__ = [
    # mesh and layouts
    "Mesh",
    "Params",
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
    "Placement",
    "place",
    "read_placement",
    # load, compile, generate
    "load_checkpoint",
    "read_config",
    "from_dtensor_state",
    "save_checkpoint",
    "compile_model",
    "CompileOptions",
    "CompiledModel",
    "greedy_generate",
    # training
    "value_and_grad",
    "token_logprobs",
    "lm_loss",
    "AdamW",
    "compile_train_step",
    "reshard_params",
    # namespaces
    "models",
    "interop",
    "eplb",
]
