"""Rank jobs that write a DCP checkpoint the way FSDP2 users do."""

import torch


def save_fsdp2_dcp(ctx, family: str, path: str, seed: int) -> None:
    """The family's tiny transformers model (seeded as ``save_tiny``), FSDP2-wrapped (``fully_shard`` per layer and
    the whole, over dp = the world) and saved with ``torch.distributed.checkpoint`` from its ``state_dict()`` of
    DTensors; rank 0 writes ``config.json`` beside it."""
    import shutil

    import torch.distributed.checkpoint as dcp

    model, config_dir = _fsdp2_model(ctx, family, seed)
    dcp.save(model.state_dict(), checkpoint_id=path)
    if ctx.rank == 0:
        shutil.copy(f"{config_dir}/config.json", f"{path}/config.json")


def fsdp2_to_tp_generate(ctx, family: str, seed: int, prompts, new: int):
    """The family's tiny model FSDP2-wrapped over the world, its ``state_dict()`` of DTensors resharded straight to
    this library's tp plan (tp = the world), and to a layer-sharded plan (o_proj and down over dp = the world);
    greedy tokens and this rank's traffic for each."""
    from functional_npu import Plan, compile_model, greedy_generate
    from functional_npu.parallel.layer_shard import layer_shard
    from functional_npu.runtime.checkpoint import read_config
    from functional_npu.runtime.train_state import from_dtensor_state

    model, path = _fsdp2_model(ctx, family, seed)
    cfg = read_config(path)
    out = {}
    mesh = ctx.mesh({"dp": 1, "tp": ctx.world_size})
    plans: list = []
    params = from_dtensor_state(model.state_dict(), cfg, mesh, report=plans)
    out["tp"] = greedy_generate(params, prompts, new, mesh), plans[0].traffic[ctx.rank]
    mesh = ctx.mesh({"dp": ctx.world_size, "tp": 1})
    ls = layer_shard("o_proj,down_proj", "dp")
    params = from_dtensor_state(model.state_dict(), cfg, mesh, Plan(layer_shard=ls), report=plans)
    owned = {leaf: x.shape[0] for leaf, x in params["series"].items()}
    tokens = compile_model(params, mesh, backend="none").generate(prompts, new)  # each layer broadcast by its owner
    out["layer_sharded"] = tokens, plans[1].traffic[ctx.rank], owned
    return out


def trained_meshes_to_tp_generate(ctx, family: str, seed: int, prompts, new: int):
    """On 4 ranks, the family's tiny model under FSDP2 + TP on ``(dp_shard 2, tp 2)`` (torchtitan's plan: q/k/v and
    gate/up column-parallel, o/down row-parallel, so FSDP2 leaves strided shards on the column-parallel weights) and
    under HSDP on ``(dp_replicate 2, dp_shard 2)``; each state resharded to this library's plan on ``{"tp": 4}`` and
    on ``{"dp": 2, "tp": 2}``. Returns, per (training, serving) pair: greedy tokens, this rank's traffic, and the
    placement types the state held."""
    from functional_npu import greedy_generate
    from functional_npu.runtime.checkpoint import read_config
    from functional_npu.runtime.train_state import from_dtensor_state

    out = {}
    for training in ("fsdp2+tp", "hsdp"):
        model, path = _fsdp2_model(ctx, family, seed, training)
        cfg = read_config(path)
        kinds = sorted({type(p).__name__ for v in model.state_dict().values() for p in v.placements})
        for serving in ({"tp": 4}, {"dp": 2, "tp": 2}):
            plans: list = []
            params = from_dtensor_state(model.state_dict(), cfg, ctx.mesh(serving), report=plans)
            tokens = greedy_generate(params, prompts, new, ctx.mesh(serving))
            out[training, str(serving)] = (tokens, plans[0].traffic[ctx.rank], kinds)
    return out


def moe_states_to_plans(ctx, family: str, seed: int, prompts, new: int, checkpoint: str):
    """The MoE family's tiny model under FSDP2 over the world, two ways: its own ``state_dict()`` (transformers'
    fused experts, ``[E, gate|up, D]``) and one DTensor per expert read from its checkpoint (as a per-expert
    model holds them), each sharded on dim 0 over ``dp_shard``. Each goes to the plan on ``{"tp": n}`` with the
    experts replicated and tp inside them, and with the experts over tp. Returns greedy tokens and this rank's
    traffic per (state, plan)."""
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from functional_npu import Plan, greedy_generate
    from functional_npu.runtime.checkpoint import read_config
    from functional_npu.runtime.train_state import from_dtensor_state

    model, path = _fsdp2_model(ctx, family, seed)
    fused = model.state_dict()
    dm = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp_shard",))
    per_expert = {
        k: distribute_tensor(v, dm, [Shard(0)]) for k, v in load_file(f"{checkpoint}/model.safetensors").items()
    }
    assert any(".experts.gate_up_proj" in k for k in fused) and any(".experts.0." in k for k in per_expert)
    mesh = ctx.mesh({"tp": ctx.world_size})
    out = {}
    for state_name, state in (("fused", fused), ("per_expert", per_expert)):
        for plan, axes in (("tp", ()), ("ep", ("tp",))):
            cfg = read_config(path)
            plans: list = []
            params = from_dtensor_state(state, cfg, mesh, Plan(expert_axes=axes), report=plans)
            out[state_name, plan] = (greedy_generate(params, prompts, new, mesh), plans[0].traffic[ctx.rank])
    return out


def _fsdp2_model(ctx, family: str, seed: int, training: str = "fsdp2"):
    """(the wrapped model, a directory holding its config.json). ``training``: ``fsdp2`` (over the world),
    ``fsdp2+tp`` (``(dp_shard 2, tp n/2)``, TP first) or ``hsdp`` (``(dp_replicate 2, dp_shard n/2)``)."""
    import tempfile

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .hf_models import COMMON, FAMILIES, MOE_COMMON, MOE_FAMILIES

    cls, cfg_cls, extra = FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**((COMMON if family in FAMILIES else MOE_COMMON) | extra))).eval()
    if training == "fsdp2":
        mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp_shard",))
    elif training == "hsdp":
        mesh = init_device_mesh("cpu", (2, ctx.world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        both = init_device_mesh("cpu", (2, ctx.world_size // 2), mesh_dim_names=("dp_shard", "tp"))
        plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
        plan |= {f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
        plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer, both["tp"], plan)
        mesh = both["dp_shard"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    path = tempfile.mkdtemp()
    model.config.architectures = [cls.__name__]
    model.config.save_pretrained(path)
    return model, path
