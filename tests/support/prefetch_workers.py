"""Functions the layer-sharding tests run on every rank (module level, so they pickle by reference)."""

from __future__ import annotations

import math

import torch


def generate_layer_sharded(
    ctx, model_dir: str, axes: dict, series: str, k: int, prompts, new_tokens: int, backend: str
):
    """Load with ``series`` layer-sharded over dp, generate;
    returns (tokens, series shapes, resident bytes, state bytes)."""
    from functional_npu import Plan, compile_model, greedy_generate, load_checkpoint
    from functional_npu.parallel.layer_shard import layer_shard, resident_bytes

    mesh = ctx.mesh(axes)
    params = load_checkpoint(model_dir, mesh, Plan(layer_shard=layer_shard(series, "dp"), prefetch_step=k))
    if backend == "none":
        tokens = greedy_generate(params, prompts, new_tokens, mesh)
        state_bytes = 0
    else:
        torch._dynamo.reset()
        model = compile_model(params, mesh, backend=backend, batch_sizes=[1, 4], max_seq_len=64)
        tokens = model.generate(prompts, new_tokens)
        state = model.new_state(1)
        state_bytes = resident_bytes(state.prefetched)
        from functional_npu.parallel.prefetch import drain

        drain(state.prefetched)
    shapes = {leaf: tuple(x.shape) for leaf, x in params["series"].items()}
    layers = params["config"].num_layers
    replicated = layers * sum(
        math.prod(x.shape[1:]) * x.element_size() for x in params["series"].values()
    )  # this rank's share without layer sharding
    return tokens, shapes, resident_bytes(params["series"]), state_bytes, replicated


def decode_code(ctx, model_dir: str, axes: dict, series: str, k: int):
    """The inductor code of one decode step of a layer-sharded model compiled with prefetch step ``k``."""
    from torch._inductor.utils import run_and_get_code

    from functional_npu import Plan, compile_model, load_checkpoint
    from functional_npu.parallel.layer_shard import layer_shard
    from functional_npu.parallel.prefetch import drain

    mesh = ctx.mesh(axes)
    params = load_checkpoint(model_dir, mesh, Plan(layer_shard=layer_shard(series, "dp"), prefetch_step=k))
    torch._dynamo.reset()
    model = compile_model(params, mesh, batch_sizes=[1], max_seq_len=64)
    state = model.new_state(1)
    with torch.no_grad():
        _, code = run_and_get_code(model.decode, torch.tensor([3]), torch.tensor([5]), state)
    drain(state.prefetched)
    return code[0]
