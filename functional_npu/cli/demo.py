"""The README's main job: an embedded Qwen3-style model, generated eager on one rank and compiled on two.

No network, no downloads: the weights are seeded random numbers written as a HF checkpoint to a
temp dir. Two local gloo ranks load it with tp=2 (each reads only its slices), compile prefill and
decode with inductor, and generate; the tokens must equal the eager single-rank run.
"""

from __future__ import annotations

import tempfile
import time

from ..core.tree import flatten_with_paths
from ..models.llama import LlamaConfig, abstract_params, init_params
from ..runtime.launch import LocalWorld, RankContext
from ..runtime.save import save_checkpoint
from .runner import generate_on_rank, in_prompt_order, tokens_per_s

DEMO_CONFIG = LlamaConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=384,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=512,
    qk_norm=True,
)
DEMO_PROMPTS = [[11, 42, 7, 300, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 99], [256, 17]]


def run_demo(tp: int = 2, new_tokens: int = 24, *, timeout: float = 600.0) -> int:
    """Print a table of tokens/s (eager vs compiled) and compile time; return 0 if all runs agree."""
    cfg = DEMO_CONFIG
    params_m = sum(x.numel() for _, x in flatten_with_paths(abstract_params(cfg))) / 1e6
    print(
        f"functional-npu demo: embedded {cfg.architecture}-style model ({params_m:.1f}M params, "
        f"{cfg.num_layers} layers, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads), "
        f"{len(DEMO_PROMPTS)} prompts, {new_tokens} new tokens each"
    )
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(init_params(cfg, seed=0), tmp)
        t0 = time.perf_counter()
        ref = generate_on_rank(
            RankContext(0, 1), tmp, {"dp": 1, "tp": 1}, DEMO_PROMPTS, new_tokens, backend="none", repeat=2
        )
        print(f"eager, 1 rank: done in {time.perf_counter() - t0:.1f}s; starting {tp} local ranks ...")
        axes = {"dp": 1, "tp": tp}
        with LocalWorld(tp, timeout=timeout, remove_when_orphaned=(tmp,)) as world:
            eager = world.run(generate_on_rank, tmp, axes, DEMO_PROMPTS, new_tokens, backend="none", repeat=2)
            compiled = world.run(generate_on_rank, tmp, axes, DEMO_PROMPTS, new_tokens, backend="inductor", repeat=2)
    want = ref["tokens"]
    rows = [
        ("eager (plain forward)", 1, want, tokens_per_s([ref], new_tokens), None),
        ("eager (plain forward)", tp, in_prompt_order(eager, len(DEMO_PROMPTS)), tokens_per_s(eager, new_tokens), None),
        (
            "compiled (inductor, fullgraph)",
            tp,
            in_prompt_order(compiled, len(DEMO_PROMPTS)),
            tokens_per_s(compiled, new_tokens),
            max(r["timings"]["first_generate_s"] - r["timings"]["generate_s"] for r in compiled),
        ),
    ]
    print("\n| run | tp ranks | tokens | tokens/s | compile s | same tokens as eager 1-rank |")
    print("|---|---|---|---|---|---|")
    ok = True
    for name, ranks, toks, tps, comp in rows:
        same = toks == want
        ok &= same
        print(
            f"| {name} | {ranks} | {sum(map(len, toks))} | {tps:.1f} "
            f"| {'' if comp is None else f'{comp:.1f}'} | {same} |"
        )
    print(f"\nfirst prompt -> {want[0][:12]} ...")
    print("demo: OK" if ok else "demo: FAILED (tokens differ)")
    return 0 if ok else 1
