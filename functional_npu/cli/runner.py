"""One rank's generation job, shared by the CLI's local ranks and torchrun: load, compile, generate.

Prompts are dealt to data-parallel ranks round-robin (prompt ``i`` to dp index ``i % dp``); the
caller puts the results back in prompt order with :func:`in_prompt_order`. When the experts of an MoE
model are sharded over ``dp`` the expert exchange spans dp ranks, so every rank runs the same steps on
the same shapes: its batch is padded with dummy prompts to the same count and width everywhere.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any


from ..runtime.checkpoint import load_checkpoint
from ..runtime.compile import cache_length, compile_model
from ..runtime.generate import greedy_generate
from ..runtime.launch import RankContext
from ..parallel.layer_shard import LayerShard


def generate_on_rank(
    ctx: RankContext,
    model_dir: str,
    axes: Mapping[str, int],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    backend: str = "auto",
    sampling: Mapping[str, Any] | None = None,
    repeat: int = 1,
    expert_axes: Sequence[str] = (),
    layer_shard: LayerShard | None = None,
    prefetch_step: int = 0,
) -> dict[str, Any]:
    """Generate for this rank's share of ``prompts``; ``repeat > 1`` reruns the compiled model to time it warm.

    ``expert_axes``: shard an MoE model's experts over these mesh axes (expert parallelism).
    ``layer_shard``: every rank of its axis shares each weight broadcast, so ranks with fewer prompts
    run dummy steps until the busiest one is done.
    """
    mesh = ctx.mesh(axes)
    t0 = time.perf_counter()
    params = load_checkpoint(model_dir, mesh, expert_axes=expert_axes, layer_shard=layer_shard)
    t_load = time.perf_counter() - t0
    dp, index = mesh.axis_size("dp"), mesh.axis_index("dp")
    mine = list(range(index, len(prompts), dp))
    longest = max((len(prompts[i]) for i in mine), default=1)
    timings: dict[str, float] = {"load_s": t_load}
    batch = [prompts[i] for i in mine]
    shapes: dict[str, Any] = {}
    if "dp" in expert_axes:  # lockstep over dp: same prompt count and width on every rank, dummies dropped after
        longest = max(len(p) for p in prompts)
        batch += [[0]] * (-(-len(prompts) // dp) - len(batch)) + [[0] * longest]
        shapes = {"prefill_lengths": (longest,), "batch_sizes": (min(len(batch), 8),)}
    lockstep = layer_shard is not None and mesh.axis_size(layer_shard.axis) > 1
    busiest = math.ceil(len(prompts) / dp)  # prompts of the dp rank dealt the most
    if backend == "none":  # the plain eager forward, no compile_model
        def run() -> list[list[int]]:
            if not batch:  # a rank with no prompts still takes its part in every broadcast
                greedy_generate(params, [[0]], max_new_tokens, mesh, prefetch_step=prefetch_step)
                return []
            return greedy_generate(params, batch, max_new_tokens, mesh, prefetch_step=prefetch_step)[: len(mine)]
    else:
        model = compile_model(params, mesh, backend=backend, max_seq_len=cache_length(longest + max_new_tokens), prefetch_step=prefetch_step, **shapes)
        chunks = math.ceil(busiest / model.batch_sizes[-1]) if lockstep else 0

        def run() -> list[list[int]]:
            return model.generate(batch, max_new_tokens, **(sampling or {}), lockstep_chunks=chunks)[: len(mine)]

    tokens: list[list[int]] = []
    for r in range(repeat):
        t0 = time.perf_counter()
        tokens = run() if batch or lockstep else []
        timings["first_generate_s" if r == 0 else "generate_s"] = time.perf_counter() - t0
    timings.setdefault("generate_s", timings["first_generate_s"])
    return {"indices": mine, "tokens": tokens, "timings": timings, "tp_index": mesh.axis_index("tp")}


def in_prompt_order(results: Sequence[Mapping[str, Any]], n: int) -> list[list[int]]:
    """Token lists in prompt order from every rank's result (tp index 0 of each dp group speaks)."""
    out: list[list[int] | None] = [None] * n
    for r in results:
        if r["tp_index"] == 0:
            for i, toks in zip(r["indices"], r["tokens"]):
                out[i] = toks
    missing = [i for i, t in enumerate(out) if t is None]
    if missing:
        raise RuntimeError(f"no rank returned prompts {missing}")
    return out  # type: ignore[return-value]


def tokens_per_s(results: Sequence[Mapping[str, Any]], new_tokens: int, key: str = "generate_s") -> float:
    """Generated tokens per second over the whole job (slowest rank)."""
    produced = sum(len(r["indices"]) for r in results if r["tp_index"] == 0) * new_tokens
    return produced / max(r["timings"].get(key, float("nan")) for r in results)


__all__ = ["generate_on_rank", "in_prompt_order", "tokens_per_s"]
