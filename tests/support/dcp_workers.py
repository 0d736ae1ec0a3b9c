"""Rank jobs that write a DCP checkpoint the way FSDP2 users do, and that reshard FSDP2 states to this library's
plans. Each reshard's bytes are counted at the collectives it dispatches and set against a lower bound that shares
no code with the reshard: the same model built with every element its own id (``ids=True``), its FSDP2 shards
telling what each rank holds, and the checkpoint loader, run on those weights as transformers saves them
(:func:`save_ids`), what each rank needs."""

import torch

from benchmarks.counting import ReceivedBytes, need_of_ids


def save_fsdp2_dcp(ctx, family: str, path: str, seed: int) -> None:
    """The family's tiny transformers model (seeded as ``save_tiny``), FSDP2-wrapped (``fully_shard`` per layer and
    the whole, over dp = the world) and saved with ``torch.distributed.checkpoint`` from its ``state_dict()`` of
    DTensors; rank 0 writes ``config.json`` beside it."""

    import torch.distributed.checkpoint as dcp

    model, _ = _fsdp2_model(ctx, family, seed)
    dcp.save(model.state_dict(), checkpoint_id=path)
    if ctx.rank == 0:
        model.config.to_json_file(f"{path}/config.json")


def counted_from_dtensor_state(state, cfg, mesh, plan=None):
    """``from_dtensor_state`` with the bytes this rank received in its exchange, counted at the collectives: (params,
    bytes). The ranks' agreement on their checks before the exchange (object all-gathers of each rank's outcome, the
    dtypes and layouts it read: ``c10d.allgather_``, which the exchange does not use) is counted apart."""
    from functional_npu.runtime.loading.dtensor_state import from_dtensor_state

    with ReceivedBytes() as counted:
        params = from_dtensor_state(state, cfg, mesh, plan)
    return params, counted.received - counted.by_op["c10d.allgather_"]


def lower_bound(ids_state, ids_dir: str, axes: dict[str, int], rank: int, plan=None) -> int:
    """Bytes world rank ``rank`` needs for ``plan`` on ``axes`` and does not hold: element ids it needs (the loader's
    slices of the ids checkpoint at ``ids_dir``) missing from those its shards of ``ids_state`` hold. float32."""
    from functional_npu import Mesh, flatten_with_paths
    from functional_npu.runtime.loading.checkpoint import load_checkpoint

    local = load_checkpoint(ids_dir, Mesh.abstract(axes, rank), plan)
    needed = [x for p, x in flatten_with_paths(local) if not p.endswith("expert_map")]  # expert maps: computed
    return need_of_ids([v.to_local() for v in ids_state.values()], needed, 4).missing


def fsdp2_to_tp_generate(ctx, family: str, seed: int, prompts, new: int, ids_dir: str):
    """The family's tiny model FSDP2-wrapped over the world, its ``state_dict()`` of DTensors resharded straight to
    this library's tp plan (tp = the world), and to a layer-sharded plan (o_proj and down over dp = the world);
    greedy tokens, the bytes this rank received and its lower bound for each."""
    from functional_npu import Plan, compile_model, greedy_generate
    from functional_npu.parallel.layer_shard import layer_shard

    model, cfg = _fsdp2_model(ctx, family, seed)
    ids, _ = _fsdp2_model(ctx, family, seed, ids=True)
    out = {}
    axes = {"dp": 1, "tp": ctx.world_size}
    mesh = ctx.mesh(axes)
    params, counted = counted_from_dtensor_state(model.state_dict(), cfg, mesh)
    need = lower_bound(ids.state_dict(), ids_dir, axes, ctx.rank)
    out["tp"] = greedy_generate(params, prompts, new, mesh), counted, need
    axes = {"dp": ctx.world_size, "tp": 1}
    mesh = ctx.mesh(axes)
    plan = Plan(layer_shard=layer_shard("o_proj,down_proj", "dp"))
    params, counted = counted_from_dtensor_state(model.state_dict(), cfg, mesh, plan)
    need = lower_bound(ids.state_dict(), ids_dir, axes, ctx.rank, plan)
    owned = {leaf: x.shape[0] for leaf, x in params["series"].items()}
    tokens = compile_model(params, mesh, backend="none").generate(prompts, new)  # each layer broadcast by its owner
    out["layer_sharded"] = tokens, counted, need, owned
    return out


def trained_meshes_to_tp_generate(ctx, family: str, seed: int, prompts, new: int, ids_dir: str):
    """On 4 ranks, the family's tiny model under FSDP2 + TP on ``(dp_shard 2, tp 2)`` (torchtitan's plan: q/k/v and
    gate/up column-parallel, o/down row-parallel, so FSDP2 leaves strided shards on the column-parallel weights) and
    under HSDP on ``(dp_replicate 2, dp_shard 2)``; each state resharded to this library's plan on ``{"tp": 4}`` and
    on ``{"dp": 2, "tp": 2}``. Returns, per (training, serving) pair: greedy tokens, the bytes this rank received,
    its lower bound, and the placement types the state held."""
    from functional_npu import greedy_generate

    out = {}
    for training in ("fsdp2+tp", "hsdp"):
        model, cfg = _fsdp2_model(ctx, family, seed, training)
        ids, _ = _fsdp2_model(ctx, family, seed, training, ids=True)
        kinds = sorted({type(p).__name__ for v in model.state_dict().values() for p in v.placements})
        for serving in ({"tp": 4}, {"dp": 2, "tp": 2}):
            params, counted = counted_from_dtensor_state(model.state_dict(), cfg, ctx.mesh(serving))
            need = lower_bound(ids.state_dict(), ids_dir, serving, ctx.rank)
            tokens = greedy_generate(params, prompts, new, ctx.mesh(serving))
            out[training, str(serving)] = (tokens, counted, need, kinds)
    return out


def moe_states_to_plans(ctx, family: str, seed: int, prompts, new: int, checkpoint: str, ids_dir: str):
    """The MoE family's tiny model under FSDP2 over the world, two ways: its own ``state_dict()`` (transformers'
    fused experts, ``[E, gate|up, D]``) and one DTensor per expert read from its checkpoint (as a per-expert
    model holds them), each sharded on dim 0 over ``dp_shard``. Each goes to the plan on ``{"tp": n}`` with the
    experts replicated and tp inside them, and with the experts over tp. Returns greedy tokens, the bytes this rank
    received and its lower bound per (state, plan)."""
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from functional_npu import Plan, greedy_generate

    model, cfg = _fsdp2_model(ctx, family, seed)
    ids, _ = _fsdp2_model(ctx, family, seed, ids=True)
    dm = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp_shard",))

    def per_expert(directory):  # one DTensor per expert, as a per-expert model holds them
        return {k: distribute_tensor(v, dm, [Shard(0)]) for k, v in load_file(f"{directory}/model.safetensors").items()}

    states = {
        "fused": (model.state_dict(), ids.state_dict()),
        "per_expert": (per_expert(checkpoint), per_expert(ids_dir)),
    }
    assert any(".experts.gate_up_proj" in k for k in states["fused"][0])
    assert any(".experts.0." in k for k in states["per_expert"][1])
    axes = {"tp": ctx.world_size}
    mesh = ctx.mesh(axes)
    out = {}
    for state_name, (state, ids_state) in states.items():
        for plan_name, expert_axes in (("tp", ()), ("ep", ("tp",))):
            plan = Plan(expert_axes=expert_axes)
            params, counted = counted_from_dtensor_state(state, cfg, mesh, plan)
            need = lower_bound(ids_state, ids_dir, axes, ctx.rank, plan)
            out[state_name, plan_name] = (greedy_generate(params, prompts, new, mesh), counted, need)
    return out


def _fsdp2_model(ctx, family: str, seed: int, training: str = "fsdp2", ids: bool = False):
    """(the wrapped model, its config as :func:`read_config` reads it from the saved ``config.json``). ``training``:
    ``fsdp2`` (over the world), ``fsdp2+tp`` (``(dp_shard 2, tp n/2)``, TP first) or ``hsdp`` (``(dp_replicate 2,
    dp_shard n/2)``). ``ids``: every element of every weight is its own id, as :func:`save_ids` numbers them."""
    import tempfile

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from functional_npu.runtime.loading.checkpoint import read_config

    model = _model(family, seed)
    if ids:
        _number_elements(model)
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
    with tempfile.TemporaryDirectory() as path:
        model.config.save_pretrained(path)
        return model, read_config(path)


def save_ids(family: str, path: str) -> str:
    """The family's tiny model with every element of every weight its own id, saved to ``path`` by transformers (in
    this process: transformers saves on rank 0 only under torch.distributed); returns ``path``."""
    model = _model(family, 0)
    _number_elements(model)
    model.save_pretrained(path)
    return path


def _model(family: str, seed: int):
    from .hf_models import COMMON, FAMILIES, MOE_COMMON, MOE_FAMILIES

    cls, cfg_cls, extra = FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**((COMMON if family in FAMILIES else MOE_COMMON) | extra))).eval()
    model.config.architectures = [cls.__name__]
    return model


def _number_elements(model) -> None:
    """Every element of every weight its own id: 0, 1, 2, ... over the weights in turn (tied ones once; exact in
    float32)."""
    seen, at = set(), 0
    with torch.no_grad():
        for p in model.state_dict().values():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                p.copy_(torch.arange(at, at + p.numel(), dtype=torch.float64).reshape(p.shape))
                at += p.numel()
    assert at < 2**24, at  # every id exact in float32
