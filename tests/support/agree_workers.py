"""Rank jobs for the agreement tests: one rank's input differs from the others', and every rank must raise the same
error at once instead of one raising while the others wait in the exchange."""

import os
import time

import torch

O_PROJ = "model.layers.1.self_attn.o_proj.weight"


def outcome(fn, *args, **kwargs) -> tuple[str, str, float]:
    """(the exception's type name or "ok", its message, seconds the call took on this rank)."""
    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def one_rank_differs(ctx, model_dir: str, damaged_dir: str) -> tuple[dict, int]:
    """Each case where one rank's input differs from the others': ``{case: outcome}`` on this rank, and its pid.

    The qwen3 tiny model under FSDP2 over the world (seed 0): rank 0's state lacks ``lm_head.weight``; rank 1's
    o_proj is int64; rank 1's whole state is bf16 (the others' fp32). ``load_checkpoint`` of ``damaged_dir`` on
    rank 0 and ``model_dir`` elsewhere. ``from_megatron`` with rank 0's chunk lacking ``output_layer.weight``."""
    from functional_npu import shard
    from functional_npu.interop.megatron import from_megatron, megatron_pipeline_specs, stack_layers, to_megatron
    from functional_npu.models.llama import init_params
    from functional_npu.runtime.loading.checkpoint import load_checkpoint
    from functional_npu.runtime.loading.dtensor_state import from_dtensor_state

    from .dcp_workers import _fsdp2_model

    model, cfg = _fsdp2_model(ctx, "qwen3", 0)
    mesh, state = ctx.mesh({"tp": ctx.world_size}), model.state_dict()
    out = {}
    lacking = {k: v for k, v in state.items() if ctx.rank or k != "lm_head.weight"}
    out["lm_head missing on rank 0"] = outcome(from_dtensor_state, lacking, cfg, mesh)
    ints = state | ({O_PROJ: state[O_PROJ].to(torch.int64)} if ctx.rank == 1 else {})
    out["o_proj int64 on rank 1"] = outcome(from_dtensor_state, ints, cfg, mesh)
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()} if ctx.rank == 1 else state
    out["bf16 on rank 1"] = outcome(from_dtensor_state, bf16, cfg, mesh)
    out["rank 0's files damaged"] = outcome(load_checkpoint, damaged_dir if ctx.rank == 0 else model_dir, mesh)
    mcfg = _megatron_cfg()
    specs, mmesh = megatron_pipeline_specs(mcfg, pp=1), ctx.mesh({"pp": 1, "tp": ctx.world_size})
    chunks = to_megatron(shard(stack_layers(init_params(mcfg, seed=1)), specs, mmesh), 1)
    if ctx.rank == 0:
        del chunks[0]["output_layer.weight"]
    out["megatron output_layer missing on rank 0"] = outcome(from_megatron, chunks, mcfg, specs, mmesh)
    return out, os.getpid()


def mixed_dtypes_generate(ctx, new: int) -> dict:
    """The qwen3 tiny model under FSDP2 with o_proj of layer 1 in bf16 among fp32 weights, on every rank: the
    params' dtypes and greedy tokens, by default (the embedding's fp32) and with ``dtype=torch.bfloat16``."""
    from functional_npu import flatten_with_paths, greedy_generate
    from functional_npu.runtime.loading.dtensor_state import from_dtensor_state

    from .dcp_workers import _fsdp2_model

    model, cfg = _fsdp2_model(ctx, "qwen3", 0)
    mesh = ctx.mesh({"tp": ctx.world_size})
    state = model.state_dict()
    state[O_PROJ] = state[O_PROJ].to(torch.bfloat16)
    out = {}
    for name, dtype in (("default", None), ("bf16", torch.bfloat16)):
        params = from_dtensor_state(state, cfg, mesh, dtype=dtype)
        dtypes = sorted({str(x.dtype) for _, x in flatten_with_paths(params) if torch.is_tensor(x)})
        out[name] = dtypes, greedy_generate(params, [[5, 6, 7]], new, mesh)
    return out


def _megatron_cfg():
    from functional_npu.models.llama import LlamaConfig

    return LlamaConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        qk_norm=True,
    )
