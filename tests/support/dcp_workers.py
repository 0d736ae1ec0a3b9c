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
    this library's tp plan (tp = the world), then greedy tokens; with the exchange's traffic for this rank."""
    from functional_npu import greedy_generate
    from functional_npu.runtime.checkpoint import read_config
    from functional_npu.runtime.train_state import from_dtensor_state

    model, path = _fsdp2_model(ctx, family, seed)
    cfg = read_config(path)
    mesh = ctx.mesh({"dp": 1, "tp": ctx.world_size})
    plans: list = []
    params = from_dtensor_state(model.state_dict(), cfg, mesh, report=plans)
    traffic = plans[0].traffic[ctx.rank]
    return greedy_generate(params, prompts, new, mesh), traffic


def _fsdp2_model(ctx, family: str, seed: int):
    """(the FSDP2-wrapped model, a directory holding its config.json)."""
    import tempfile

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .hf_models import COMMON, FAMILIES

    cls, cfg_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**(COMMON | extra))).eval()
    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    path = tempfile.mkdtemp()
    model.config.architectures = [cls.__name__]
    model.config.save_pretrained(path)
    return model, path
