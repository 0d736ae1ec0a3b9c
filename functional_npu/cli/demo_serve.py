"""The demo's serving part: a short mixed stream of requests through the request engine, beside lockstep generate.

Sixteen requests of different prompt lengths (1-16 tokens) and outputs (2-60 tokens, most short and a few long,
as rollouts and chats run) are served by the demo model,
compiled with inductor on one rank (in a rank process of its own, as every compile of the demo), two ways:

- the **engine** (:class:`~functional_npu.runtime.serving.Engine`): continuous batching over a paged KV cache, at
  most 4 sequences at once, a finished request's row taken by the next one at the following step;
- **lockstep generate**: the same requests in arrival order, 4 at a time, each batch run to its longest request
  (what a caller of ``generate`` does with a stream).

Both run on the same compiled model (a decode graph at batch 4; the engine's prefill chunks of 8 positions, lockstep's
prompts of up to 16); served tokens/s
counts each request's own tokens. Each request's tokens are compared with lockstep generate's (greedy: the same
unless a near-tie flips with the batch's other rows, which the invariant plan rules out, ``docs/serving.md``).
"""

from __future__ import annotations

import time
from typing import Any

from ..runtime.launch import LocalWorld, RankContext

ROWS = 4  # the compiled batch: sequences at once
PROMPT = 16  # the lockstep prefill's compiled length: the longest prompt
CHUNK = 8  # the engine's prefill chunk: a longer prompt takes two steps, beside the running decodes
PROMPT_LENGTHS = (3, 14, 7, 1, 16, 9, 5, 12, 2, 15, 8, 11, 6, 13, 4, 10)
NEW_TOKENS = (60, 3, 5, 2, 4, 56, 2, 6, 3, 5, 52, 2, 2, 4, 3, 58)  # most short, a few long: as rollouts and chats run


def requests() -> list[tuple[list[int], int]]:
    """The demo's stream: (prompt, new tokens) in arrival order."""
    return [([1 + (7 * i + j) % 500 for j in range(n)], m) for i, (n, m) in enumerate(zip(PROMPT_LENGTHS, NEW_TOKENS))]


def _on_rank(ctx: RankContext, model_dir: str) -> dict[str, Any]:
    from ..core.mesh import Mesh
    from ..runtime.loading.checkpoint import load_checkpoint
    from ..runtime.serving import Engine, Request
    from ..runtime.serving.compile import compile_model

    mesh = Mesh.abstract({"tp": 1}, 0)
    context = max(PROMPT_LENGTHS) + max(NEW_TOKENS)
    model = compile_model(load_checkpoint(model_dir, mesh), mesh, backend="inductor", batch_sizes=[ROWS],
                          max_seq_len=context, prefill_lengths=[CHUNK, PROMPT])  # fmt: skip
    engine = Engine(model, blocks=ROWS * -(-context // 8) + 1, block_size=8, chunk=CHUNK, stop=())
    stream = requests()

    def served() -> list[list[int]]:
        out: dict[int, list[int]] = {}
        for event in engine.run([Request(tuple(p), n, stop=()) for p, n in stream]):
            out.setdefault(event.id, []).extend(event.tokens)
        return [out[i] for i in sorted(out)]

    def lockstep() -> list[list[int]]:
        out = []
        for at in range(0, len(stream), ROWS):
            group = stream[at : at + ROWS]
            tokens = model.generate([p for p, _ in group], max(n for _, n in group))
            out += [t[:n] for t, (_, n) in zip(tokens, group)]
        return out

    start = time.perf_counter()
    served(), lockstep()  # compiles both graphs
    compile_s = time.perf_counter() - start
    times: dict[str, list[float]] = {"engine": [], "lockstep": []}
    for _ in range(2):  # interleaved rounds
        for name, run in (("engine", served), ("lockstep", lockstep)):
            start = time.perf_counter()
            tokens = run()
            times[name].append(time.perf_counter() - start)
            if name == "engine":
                engine_tokens = tokens
            else:
                lockstep_tokens = tokens
    return {"engine": engine_tokens, "lockstep": lockstep_tokens, "times": times, "compile_s": compile_s}


def run_serving(model_dir: str, timeout: float) -> dict[str, Any]:
    """The serving comparison in a rank process of its own."""
    with LocalWorld(1, timeout=timeout, remove_when_orphaned=(model_dir,)) as world:
        return world.run(_on_rank, model_dir)[0]


def print_serving(r: dict[str, Any]) -> None:
    """The two rows and what they show (the demo does not fail on a flipped near-tie: it says how many agree)."""
    new = sum(NEW_TOKENS)
    rate = {name: new / min(t) for name, t in r["times"].items()}
    same = sum(a == b for a, b in zip(r["engine"], r["lockstep"]))
    print(
        f"\nserving {len(NEW_TOKENS)} requests (prompts {min(PROMPT_LENGTHS)}-{max(PROMPT_LENGTHS)} tokens, "
        f"{min(NEW_TOKENS)}-{max(NEW_TOKENS)} new each, {new} in all) on 1 rank, compiled ({r['compile_s']:.0f}s):"
    )
    print(f"| engine (continuous batching, paged KV, {ROWS} at once) | {rate['engine']:.1f} served tokens/s |")
    lock = f"lockstep generate ({ROWS} at a time, each batch to its longest)"
    print(f"| {lock} | {rate['lockstep']:.1f} served tokens/s |")
    print(
        f"the engine serves {rate['engine'] / rate['lockstep']:.2f}x lockstep's tokens/s; {same} of "
        f"{len(NEW_TOKENS)} requests have lockstep's tokens (python -m benchmarks serve measures 64 requests)"
    )
