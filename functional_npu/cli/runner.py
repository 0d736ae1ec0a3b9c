"""One rank's generation job, shared by the CLI's local ranks and torchrun: load, compile, generate.

Prompts are dealt to data-parallel ranks round-robin (prompt ``i`` to dp index ``i % dp``); the
caller puts the results back in prompt order with :func:`in_prompt_order`. When ranks share
collective steps across dp (the experts of an MoE model sharded over ``dp``, or weights layer-sharded
over an axis) they run in lockstep (:class:`functional_npu.runtime.serving.generate.Lockstep`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tqdm import tqdm

from ..core.mesh import Mesh
from ..parallel.module_tp import dp_axes
from ..parallel.plan import Plan
from ..placement import Placement
from ..runtime.launch import RankContext
from ..runtime.loading.checkpoint import load_checkpoint
from ..runtime.serving import CompileOptions, cache_length, compile_model
from ..runtime.serving.generate import Lockstep


def _in_lockstep(mesh: Mesh, plan: Plan) -> bool:
    """Whether the dp ranks share collective steps (their prompts differ, so their steps must be aligned)."""
    if plan.layer_shard is not None and mesh.axis_size(plan.layer_shard.axis) > 1:
        return True
    if any(mesh.axis_size(axes) > 1 for _, axes in plan.module_tp.items()):
        return True
    return any(a != plan.tp and mesh.axis_size(a) > 1 for a in plan.expert_axes)


def generate_on_rank(
    ctx: RankContext,
    model_dir: str,
    axes: Mapping[str, int],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    backend: str = "auto",
    mode: str | None = None,
    sampling: Mapping[str, Any] | None = None,
    repeat: int = 1,
    plan: Plan | Placement | None = None,
    dtype: str | None = None,
    progress: bool | None = None,
    cache_dir: str | None = None,
    time_steps: bool = False,
) -> dict[str, Any]:
    """Generate for this rank's share of ``prompts``; ``repeat > 1`` reruns the model to time it warm.

    ``backend``: any of :data:`functional_npu.runtime.serving.backends.BACKENDS` (``"none"``: the plain forward);
    ``mode``: its mode (default: the device's fastest, :func:`functional_npu.runtime.serving.backends.resolve_backend`).
    ``plan``: the parallel plan over ``axes`` (default ``Plan()``), or its placement already checked (the CLI's);
    every axis but ``plan.tp`` is data-parallel.
    A ``plan.prefetch_step`` of ``"auto"`` is the cost model's choice, reported as ``prefetch_step`` in the result.
    ``dtype``: read floating weights as ``"float32"``, ``"bfloat16"`` or ``"float16"`` (default: as stored).
    ``progress``: the loading and compiling bars on rank 0 (default: when stderr is a terminal).
    ``cache_dir``: where the compiled graphs are saved and loaded from (each rank in its own subdirectory; see
    :class:`functional_npu.runtime.serving.CompileOptions`).
    ``time_steps``: also time a prefill alone, to give the decode step's time (``decode_step_s``: the generation's
    time less the prefill's, over its decode steps) that ``generate --plan auto`` checks against the prediction.
    """
    mesh = ctx.mesh(axes)
    show = (sys.stderr.isatty() if progress is None else progress) and mesh.rank == 0  # the bars, decided once
    t0 = time.perf_counter()
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype] if dtype else None
    params = load_checkpoint(model_dir, mesh, plan, dtype=dt, progress=show)
    plan = params.placement.plan
    timings: dict[str, float] = {"load_s": time.perf_counter() - t0}
    data = dp_axes(mesh, plan.tp)
    dp = mesh.axis_size(data)
    mine = list(range(mesh.axis_index(data), len(prompts), dp))
    batch = [prompts[i] for i in mine]
    longest = max(len(p) for p in prompts)
    options = CompileOptions(
        backend=backend,
        mode=mode,
        max_seq_len=cache_length(longest + max_new_tokens, limit=params.config.max_position_embeddings),
        greedy_head=not (sampling or {}).get("temperature"),  # greedy decode steps move tokens, not logits
        cache_dir=cache_dir,
    )
    model = compile_model(params, mesh, options)
    lockstep = Lockstep.over(len(prompts), dp, longest, model.batch_sizes) if _in_lockstep(mesh, plan) else None
    t0 = time.perf_counter()
    if batch or lockstep:
        _warm_up(model, batch, sampling or {}, lockstep, show, max_new_tokens)
    timings["compile_s"] = time.perf_counter() - t0
    tokens: list[list[int]] = []
    for r in range(repeat):
        t0 = time.perf_counter()
        tokens = (
            model.generate(batch, max_new_tokens, **(sampling or {}), lockstep=lockstep) if batch or lockstep else []
        )
        timings["first_generate_s" if r == 0 else "generate_s"] = time.perf_counter() - t0
    timings.setdefault("generate_s", timings["first_generate_s"])
    if time_steps and max_new_tokens > 1 and (batch or lockstep):
        t0 = time.perf_counter()
        model.generate(batch, 1, **(sampling or {}), lockstep=lockstep)
        timings["prefill_s"] = time.perf_counter() - t0
        timings["decode_step_s"] = max(0.0, timings["generate_s"] - timings["prefill_s"]) / (max_new_tokens - 1)
    return {
        "indices": mine,
        "tokens": tokens,
        "timings": timings,
        "tp_index": mesh.axis_index(plan.tp),
        "prefetch_step": model.plan.prefetch_step,
    }


def _warm_up(model: Any, batch: list, sampling: Mapping[str, Any], lockstep: Any, show: bool, new: int) -> None:
    """Compile the graphs this job runs before timing it: generate once with one new token (the prefill graph of
    the batch's buckets), then, if the job decodes (``new`` > 1), with two (the decode graph): never more tokens
    than the job's own, which fit the model's positions; a bar on stderr if ``show``."""
    runs = ((1, "prefill"), (2, "decode"))[: min(new, 2)]
    with tqdm(total=len(runs), desc="compiling", unit="graph", disable=not show) as bar:
        for n, graph in runs:
            bar.set_postfix_str(graph)
            model.generate(batch, n, **sampling, lockstep=lockstep)
            bar.update()


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
