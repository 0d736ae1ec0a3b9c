"""MLA's cache and decode paths on one DeepSeek-V3-shaped model: a per-head KV cache vs the latent cache, and
the latent cache read through expanded keys (plain) vs in the latent space (absorbed).

    python -m benchmarks mla [--cache-lengths 256,1024,4096] [--batch 1] [--new 16] [--rounds 3]
        [--backend inductor] [--json benchmarks/results/mla.json]

One process, one rank. A decode step attends over every slot of its static cache (masked past the
sequence), so its cost grows with the cache length, which is what each row sets. Per cache length every
variant is compiled first, then ``--rounds`` rounds time them in turn (A B C ... A B C ...). Decode tokens/s
are ``batch * (N - 1) / (T(N new tokens) - T(1 new token))`` after an 8-token prompt; the table gives the
median over the rounds, the spread, and the ratio to the per-head cache from the same rounds. Cache bytes are
per token over all layers, in float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

import torch

from functional_npu import Mesh, Plan, compile_model
from functional_npu.models import Routing
from functional_npu.models.deepseek import DeepseekConfig, init_params

from . import timing
from .flags import count

# tiny but not trivial: DeepSeek-V3's ratios (R = 4 dv, dr = dv / 2, low-rank query) at a 16th of its width
CONFIG = DeepseekConfig(
    architecture="DeepseekV3ForCausalLM",
    vocab_size=8000,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=4,
    num_heads=16,
    q_lora_rank=192,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=4096,
    num_experts=16,
    top_k=2,
    moe_intermediate_size=256,
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routing=Routing(scoring="sigmoid", group_limit="top2", n_group=4, topk_group=2, scale=2.5),
)
VARIANTS = {
    "per-head cache": {"mla_cache": "heads"},
    "latent cache, plain decode": {"absorb": False},
    "latent cache, absorbed decode": {"absorb": True},
}


def measure(*, length: int, batch: int, new: int, rounds: int, backend: str) -> dict:
    """Every variant at one cache length: bytes per token, decode tokens/s per round, and the ratio to per-head."""
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = init_params(CONFIG, seed=0)
    prompts = [[1 + (7 * i + j) % 7000 for j in range(8)] for i in range(batch)]
    runs, out = {}, {}
    for name, change in VARIANTS.items():
        plan = Plan(**change)  # the cache kind and the decode path are the plan's
        model = compile_model(
            params,
            mesh,
            plan=plan,
            backend=backend,
            batch_sizes=[batch],
            max_seq_len=length,
            prefill_lengths=[8],
        )
        runs[name] = lambda n, m=model: m.generate(prompts, n)
        tokens = runs[name](new)  # compile both graphs
        runs[name](1)
        out[name] = {"tokens": tokens, "bytes": CONFIG.cache_values_per_token(plan) * CONFIG.num_layers * 4}
    times = timing.rounds(
        {name: functools.partial(timing.generate_times, run, new) for name, run in runs.items()}, rounds
    )
    base = None
    result = {}
    for name, r in out.items():
        rates = [batch * (new - 1) / (a - o) for a, o in times[name]]
        base = rates if base is None else base
        result[name] = {
            "change": VARIANTS[name],
            "cache_bytes_per_token": r["bytes"],
            "decode_tok_s": timing.stats(rates),
            "vs_per_head": timing.ratio(rates, base)["median"],
            "same_tokens": r["tokens"] == out["per-head cache"]["tokens"],
        }
    return result


def table(results: dict) -> str:
    rows = [
        "| cache length | variant | cache bytes per token (all layers) | decode tok/s: median (spread) "
        "| vs per-head cache | same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for length, result in results.items():
        for name, r in result.items():
            d = r["decode_tok_s"]
            rows.append(
                f"| {length} | {name} | {r['cache_bytes_per_token']:,} | {d['median']:.1f} ({d['min']:.1f} to "
                f"{d['max']:.1f}) | {r['vs_per_head']:.2f}x | {r['same_tokens']} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks mla", description=__doc__.splitlines()[0])
    parser.add_argument("--cache-lengths", default="256,1024,4096", help="comma-separated static cache lengths")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--rounds", type=count, default=3)
    parser.add_argument("--backend", default="inductor", choices=["inductor", "none"])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    results = {}
    for length in [int(x) for x in args.cache_lengths.split(",")]:
        results[length] = measure(
            length=length, batch=args.batch, new=args.new, rounds=args.rounds, backend=args.backend
        )
        print(table({length: results[length]}), flush=True)
    print(table(results))
    if args.json:
        meta = {"config": {k: v for k, v in dataclasses.asdict(CONFIG).items() if k != "module_tp"}, "args": vars(args)}
        Path(args.json).write_text(json.dumps({"meta": meta, "cache_lengths": results}, indent=1, default=str) + "\n")
