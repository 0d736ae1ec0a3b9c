"""Decode tokens/s of an MoE model on 2 gloo ranks: experts sharded over both ranks (ep = 2) vs replicated.

    python -m benchmarks moe [--backend inductor|eager|none] [--batch 1] [--new 32] [--layers 4]

Both runs are data parallel over the 2 ranks (each rank decodes its own batch). Replicated: every rank
holds all experts and never talks to the other. ep = 2: each rank holds half of the experts and every
MoE layer exchanges tokens (decode batches take the all_gather / reduce_scatter path). Decode tokens/s
(both ranks) are ``2 * batch * (N - 1) / (T(N new tokens) - T(1 new token))``, best of 3, slowest rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

from functional_npu.models import dense, moe
from functional_npu.parallel import Plan
from functional_npu.runtime import LocalWorld
from functional_npu.runtime.loading import load_checkpoint, save_checkpoint
from functional_npu.runtime.serving import cache_length, compile_model, greedy_generate

from .configs import QUICK
from .timing import best_time


def config(layers: int) -> moe.MoeConfig:
    base = dataclasses.replace(QUICK, num_layers=layers)  # the scoreboard's dense model, with experts
    return moe.MoeConfig(
        architecture="Qwen3MoeForCausalLM",
        **dense.dense_fields(base),
        num_experts=16,
        top_k=2,
        moe_intermediate_size=512,
        norm_topk_prob=True,
        moe_layers=tuple(range(layers)),
    )


def _rank(ctx, path: str, expert_axes: tuple[str, ...], backend: str, batch: int, new: int) -> dict[str, float]:
    mesh = ctx.mesh({"dp": 2, "tp": 1})
    params = load_checkpoint(path, mesh, Plan(expert_axes=expert_axes))
    prompts = [[1 + i + 7 * ctx.rank, 2, 3, 4, 5, 6, 7, 8] for i in range(batch)]
    if backend == "none":

        def run(n: int):
            return greedy_generate(params, prompts, n, mesh, max_seq_len=cache_length(8 + new))
    else:
        model = compile_model(
            params, mesh, backend=backend, batch_sizes=[batch], max_seq_len=cache_length(8 + new), prefill_lengths=[8]
        )

        def run(n: int):
            return model.generate(prompts, n)

    t0 = time.perf_counter()
    run(new), run(1)
    warm = time.perf_counter() - t0
    return {"all": best_time(lambda: run(new), 3), "one": best_time(lambda: run(1), 3), "warmup_s": warm}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks moe", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="inductor", choices=["inductor", "eager", "none"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    cfg = config(args.layers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LocalWorld(2, timeout=1800) as world:
        save_checkpoint(moe.init_params(cfg, seed=0), tmp)
        for name, axes in (("replicated experts", ()), ("ep = 2 (experts over dp)", ("dp",))):
            res = world.run(_rank, tmp, axes, args.backend, args.batch, args.new)
            step = max(r["all"] - r["one"] for r in res) / (args.new - 1)
            rows.append((name, 2 * args.batch / step, step * 1e3, max(r["warmup_s"] for r in res)))
    expert_mb = 3 * cfg.num_experts * cfg.moe_intermediate_size * cfg.hidden_size * 4 * args.layers / 2**20
    print(
        f"MoE decode, 2 gloo ranks, {args.backend}, batch {args.batch} per rank, {args.new} new tokens, "
        f"{cfg.num_experts} experts top-{cfg.top_k}, {args.layers} layers, {expert_mb:.0f} MiB of experts"
    )
    print("| experts | decode tok/s (2 ranks) | ms / step | warm-up s |\n|---|---|---|---|")
    for name, tps, ms, warm in rows:
        print(f"| {name} | {tps:.1f} | {ms:.1f} | {warm:.1f} |")
