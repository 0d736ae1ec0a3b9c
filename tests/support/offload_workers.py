"""Rank functions for the host-memory series' tests (tests/parallel/test_offload.py)."""

import torch


def resharded_into_host_memory(ctx, model_dir: str, prompts, new: int) -> dict:
    """Params trained under every layer layer-sharded over dp 2, resharded to tp over the same ranks with o_proj and
    down kept in host memory: whether each host layer equals the checkpoint's shard of it (loaded straight from the
    files under the same plan without offload), and the tokens of both."""
    from functional_npu import Plan, compile_model, load_checkpoint
    from functional_npu.runtime.training.weight_sync import reshard_params

    mesh = ctx.mesh({"dp": 2, "tp": 1})
    trained = load_checkpoint(model_dir, mesh, Plan(layer_shard="layer"))
    serving = reshard_params(trained, Plan(tp="dp", offload="o_proj,down_proj", prefetch_step=1), mesh)
    loaded = load_checkpoint(model_dir, mesh, Plan(tp="dp"))
    same = all(
        torch.equal(serving["host"][leaf][i], layer[leaf])
        for leaf in ("o_proj", "down")
        for i, layer in enumerate(loaded["layers"])
    )
    tokens = {}
    for name, params in (("offloaded", serving), ("resident", loaded)):
        model = compile_model(params, mesh, backend="none", batch_sizes=[4], max_seq_len=24)
        tokens[name] = model.generate(prompts, new)
    return {"same": same, "host_device": str(serving["host"]["o_proj"].device), **tokens}
