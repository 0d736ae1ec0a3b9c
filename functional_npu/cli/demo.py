"""The README's main job: an embedded Qwen3-style model, generated eager on one rank and compiled on two.

No network, no downloads: the weights are seeded random numbers written as a HF checkpoint to a
temp dir. Two local gloo ranks load it with tp=2 (each reads only its slices), compile prefill and
decode with inductor, and generate; the tokens must equal the eager single-rank run. Then the same
two ranks run it data-parallel with ``o_proj`` and ``down`` layer-sharded (each rank holds half the
layers of those weights and prefetches the others one layer ahead, in the compiled graph): the
tokens must agree again, and the demo shows the bytes each rank holds (its 3 of the 6 layers and a ring
of 2 slots: 5 layers' worth, where 4 layers would hold 2 + 2, all of them) against replicated, the
saving, and the broadcasts in flight that pay for it, read back from inductor's generated code. The
same decode on an emulated link as slow as one layer's compute, which shows how much of the
communication prefetch hides, is a benchmark: ``python -m benchmarks prefetch``, from a checkout of
the repository. Last, a short mixed stream of requests is served through the request engine beside lockstep
generate on the same compiled model (:mod:`.demo_serve`), each one's served tokens/s printed.

With ``--quant int8|int4`` the checkpoint is written quantized instead, as compressed-tensors writes it
(every linear layer but ``lm_head``, int8 per channel or int4 in groups of 32, weight-only, fp32 scales
and activations so that every run must give the same tokens), and the runs load it and use the CPU's
quantized matmuls; the demo shows the bytes each rank holds against the float model.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..checks.hazard import check
from ..checks.hazard_fx import from_inductor_code
from ..core.quant import Quant
from ..core.tree import flatten_with_paths
from ..models import embedded_config, family_of
from ..parallel.layer_shard import layer_shard, resident_bytes
from ..parallel.plan import Plan
from ..parallel.prefetch_cost import layer_bytes
from ..runtime.launch import LocalWorld, RankContext
from ..runtime.loading.save import save_checkpoint
from .demo_serve import print_serving, run_serving
from .errors import WORLD_ERRORS, world_failed
from .runner import generate_on_rank, in_prompt_order, tokens_per_s
from .scratch import scratch_dir

DEMO_HF_CONFIG = embedded_config("demo")  # the embedded model
# a smaller one for the post-training round (its compiled train step) and the smoke runs of benchmarks
SMALL_HF_CONFIG = embedded_config("small")
DEMO_MODEL = family_of(DEMO_HF_CONFIG["architectures"][0])
DEMO_CONFIG = DEMO_MODEL.from_hf(DEMO_HF_CONFIG)
SMALL_CONFIG = DEMO_MODEL.from_hf(SMALL_HF_CONFIG)
DEMO_PROMPTS = [[11, 42, 7, 300, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 99], [256, 17]]  # ids < 512: either model
DEMO_SERIES = "o_proj,down_proj"
DEMO_QUANT = {"int8": Quant(8, "channel"), "int4": Quant(4, "group", group_size=32)}


def held_bytes(ctx: RankContext, model_dir: str, tp: int) -> tuple[int, int]:
    """(bytes of this rank's weights as the compiled model holds them, of the same weights in fp32)."""
    from ..core.mesh import Mesh
    from ..runtime.loading.checkpoint import load_checkpoint
    from ..runtime.serving.compile import compile_model

    mesh = Mesh.abstract({"dp": 1, "tp": tp}, ctx.rank)
    model = compile_model(load_checkpoint(model_dir, mesh), mesh, backend="none")
    held = sum(x.numel() * x.element_size() for _, x in flatten_with_paths(model.params))
    return held, sum(x.numel() * 4 for _, x in flatten_with_paths(DEMO_MODEL.abstract_params(DEMO_CONFIG))) // tp


def layer_sharded_on_rank(
    ctx: RankContext, model_dir: str, new_tokens: int, timeout: float, cache_dir: str | None = None
) -> dict[str, Any]:
    """dp = 2, ``DEMO_SERIES`` layer-sharded with prefetch step 1, compiled: the tokens (via the CLI's rank
    job, its graphs saved to and loaded from ``cache_dir``), the series bytes this rank holds against replicated,
    and the prefetch timeline of a decode step (read from inductor's code: compiled here, never loaded)."""
    from torch._inductor.utils import run_and_get_code

    from ..parallel.prefetch import drain
    from ..runtime.loading.checkpoint import load_checkpoint
    from ..runtime.serving.compile import compile_model

    plan = Plan(layer_shard=layer_shard(DEMO_SERIES, "dp"), prefetch_step=1)
    axes = {"dp": ctx.world_size, "tp": 1}
    out = generate_on_rank(
        ctx, model_dir, axes, DEMO_PROMPTS, new_tokens, backend="inductor", plan=plan, repeat=2, cache_dir=cache_dir
    )
    mesh = ctx.mesh(axes)
    params = load_checkpoint(model_dir, mesh, plan)
    per_layer = layer_bytes(params)
    model = compile_model(params, mesh, batch_sizes=[1], max_seq_len=64)
    state = model.new_state(1)
    with torch.no_grad():
        _, code = run_and_get_code(model.decode, torch.tensor([3]), torch.tensor([5]), state)
    ring = resident_bytes(state.prefetched)
    drain(state.prefetched)
    k, groups = model.ring.k, len(model.ring.groups)
    program = from_inductor_code(code[0], k, groups)
    return out | {
        "held": resident_bytes(params["series"]) + ring,
        "replicated": params.config.num_layers * per_layer,
        "broadcasts": len(program.writes),
        "slots": k + 1,
        "hazards": check(program, k, (k + 1) * groups),
    }


def _compiled_one_rank(tmp: str, new_tokens: int, timeout: float, cache_dir: str | None) -> dict:
    """The compiled run on one rank, in a rank process of its own (as every compile of the demo: a signal to the
    demo then stops it as it stops the other ranks, leaving nothing behind)."""
    with LocalWorld(1, timeout=timeout, remove_when_orphaned=(tmp,)) as world:
        return world.run(
            generate_on_rank, tmp, {"dp": 1, "tp": 1}, DEMO_PROMPTS, new_tokens, backend="inductor", repeat=2,
            cache_dir=cache_dir,
        )[0]  # fmt: skip


def _on_ranks(tmp: str, tp: int, new_tokens: int, timeout: float, quant: str | None, cache_dir: str | None) -> tuple:
    """The demo's runs on ``tp`` local ranks: (eager, compiled, layer-sharded or None, bytes held or None)."""
    axes = {"dp": 1, "tp": tp}
    with LocalWorld(tp, timeout=timeout, remove_when_orphaned=(tmp,)) as world:
        eager = world.run(generate_on_rank, tmp, axes, DEMO_PROMPTS, new_tokens, backend="none", repeat=2)
        compiled = world.run(
            generate_on_rank, tmp, axes, DEMO_PROMPTS, new_tokens, backend="inductor", repeat=2, cache_dir=cache_dir
        )
        layered = tp == 2 and quant is None
        sharded = world.run(layer_sharded_on_rank, tmp, new_tokens, timeout, cache_dir) if layered else None
        held = world.run(held_bytes, tmp, tp) if quant else None
    return eager, compiled, sharded, held


def run_demo(
    tp: int = 2, new_tokens: int = 24, *, timeout: float = 600.0, quant: str | None = None, cache_dir: str | None = None
) -> int:
    """Print a table of tokens/s (eager vs compiled) and compile time; return 0 if all runs agree.

    ``quant``: ``"int8"`` or ``"int4"`` to run a quantized checkpoint of the same model (see the module
    docstring) instead of the layer-sharded part. ``cache_dir``: the compiled runs save their graphs there and
    a later demo loads them (its compile column is then their load)."""
    cfg = DEMO_CONFIG
    params_m = sum(x.numel() for _, x in flatten_with_paths(DEMO_MODEL.abstract_params(cfg))) / 1e6
    print(
        f"functional-npu demo: embedded {cfg.architecture}-style model ({params_m:.1f}M params, "
        f"{cfg.num_layers} layers, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads), "
        f"{len(DEMO_PROMPTS)} prompts, {new_tokens} new tokens each"
        + (f", weights quantized as {DEMO_QUANT[quant]!r} (compressed-tensors checkpoint)" if quant else "")
    )
    with scratch_dir("demo") as tmp:  # removed by the next demo if this one is SIGKILLed before its ranks start
        save_checkpoint(DEMO_MODEL.init_params(cfg, seed=0), tmp, quant=DEMO_QUANT[quant] if quant else None)
        t0 = time.perf_counter()
        ref = generate_on_rank(
            RankContext(0, 1), tmp, {"dp": 1, "tp": 1}, DEMO_PROMPTS, new_tokens, backend="none", repeat=2
        )
        print(f"eager, 1 rank: done in {time.perf_counter() - t0:.1f}s; starting local ranks ...")
        try:
            one = _compiled_one_rank(tmp, new_tokens, timeout, cache_dir)
            eager, compiled, sharded, held = _on_ranks(tmp, tp, new_tokens, timeout, quant, cache_dir)
            serving = run_serving(tmp, timeout) if quant is None else None
        except WORLD_ERRORS as e:  # as generate says it: one line, exit code 1
            return world_failed(e)
    want = ref["tokens"]
    ok = _print_rows(_rows(ref, one, eager, compiled, sharded, tp, new_tokens), want)
    if sharded is not None:
        ok &= _print_layer_sharded(sharded)
    if held is not None:
        mine, fp32 = max(held)
        print(
            f"\n{quant}: each rank holds {mine / 2**10:.0f} KiB of weights as its kernels read them, against "
            f"{fp32 / 2**10:.0f} KiB in fp32 ({mine / fp32:.0%}; lm_head and the embedding stay fp32)"
        )
    if serving is not None:
        print_serving(serving)
    print(f"\nfirst prompt -> {want[0][:12]} ...")
    print("demo: OK" if ok else "demo: FAILED (tokens differ)")
    return 0 if ok else 1


def _rows(
    ref: dict, one: dict, eager: list, compiled: list, sharded: list | None, tp: int, new_tokens: int
) -> list[tuple]:
    """The table's rows: (run, ranks, tokens in prompt order, tokens/s, compile s or None, what the row shows).
    Compiled runs are set beside the eager run at the same rank count: a ratio across rank counts would mix what
    compiling buys with what local gloo ranks cost."""
    n = len(DEMO_PROMPTS)
    eager_1, eager_tp = tokens_per_s([ref], new_tokens), tokens_per_s(eager, new_tokens)
    rows = [
        ("eager (plain forward)", 1, ref["tokens"], eager_1, None, "the reference every run must reproduce"),
        (
            "compiled (inductor, fullgraph)", 1, one["tokens"], tokens_per_s([one], new_tokens),
            one["timings"]["compile_s"], f"{tokens_per_s([one], new_tokens) / eager_1:.1f}x eager on 1 rank: what "
            f"compiling buys",
        ),
        (
            f"eager, tp = {tp}", tp, in_prompt_order(eager, n), eager_tp, None,
            "the same tokens from sliced weights; on one host each layer's all-reduce over gloo costs more than "
            "the slices save at this size (tp pays across devices, not across local processes)",
        ),
    ]  # fmt: skip
    tp_rate = tokens_per_s(compiled, new_tokens)
    compile_s = max(r["timings"]["compile_s"] for r in compiled)
    rows.append((
        f"compiled, tp = {tp}", tp, in_prompt_order(compiled, n), tp_rate, compile_s,
        f"{tp_rate / eager_tp:.1f}x eager at tp = {tp}: the compiled graph holds the collectives",
    ))  # fmt: skip
    if sharded is not None:
        rate = tokens_per_s(sharded, new_tokens)
        rows.append((
            f"compiled, dp = 2, {DEMO_SERIES} layer-sharded, prefetch 1 layer ahead", 2, in_prompt_order(sharded, n),
            rate, max(r["timings"]["compile_s"] for r in sharded),
            "each rank holds half the layers of two series and broadcasts the others one layer ahead (below)",
        ))  # fmt: skip
    return rows


def _print_rows(rows: list[tuple], want: list) -> bool:
    """Print the table; whether every run gave the eager one-rank tokens."""
    print("\n| run | ranks | tokens | tokens/s | compile s | same tokens as eager 1-rank | what it shows |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for name, ranks, toks, tps, comp, shows in rows:
        same = toks == want
        ok &= same
        print(
            f"| {name} | {ranks} | {sum(map(len, toks))} | {tps:.1f} "
            f"| {'' if comp is None else f'{comp:.1f}'} | {same} | {shows} |"
        )
    return ok


def _print_layer_sharded(sharded: list) -> bool:
    """The layer-sharded run's bytes and hazard check; whether no hazard was found."""
    r = max(sharded, key=lambda r: r["held"])
    saved = r["replicated"] - r["held"]
    print(
        f"\nlayer-sharded: each rank holds {r['held'] / 2**10:.0f} KiB of {DEMO_SERIES} (its layers and a "
        f"prefetch ring of {r['slots']} slots) instead of {r['replicated'] / 2**10:.0f} KiB replicated "
        f"({r['held'] / r['replicated']:.0%}), "
        + (f"saving {saved / 2**10:.0f} KiB" if saved > 0 else f"saving nothing ({-saved / 2**10:.0f} KiB more)")
        + f" for {r['broadcasts']} broadcasts per step; its compiled decode step writes them (one per layer) into "
        f"the ring in place, "
        + (
            "every slot access ordered (hazard check on inductor's code)."
            if not r["hazards"]
            else f"with a hazard: {r['hazards'][0]}"
        )
    )
    print(
        "the same decode on an emulated link as slow as one layer's compute, without and with prefetch: "
        "python -m benchmarks prefetch (from a checkout)"
    )
    return not r["hazards"]
