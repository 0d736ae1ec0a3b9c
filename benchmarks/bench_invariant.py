"""What an invariant mode costs: decode tokens/s at batches 1 and 8 and the train step's time, mode on and off.

    python -m benchmarks invariant [--mode batch|portable] [--dtype float32 bfloat16] [--quick] [--repeat N]
                                   [--json FILE [--append]]
    python -m benchmarks invariant --kernels     # the portable invariant linear alone: eager, inductor, matmul

One process, one rank, compiled with inductor: the embedded demo model (Qwen3-style, 6 layers, hidden 256, vocab
4096; ``--quick``: the small one, hidden 128, vocab 512) with seeded weights, in each ``--dtype``, under ``Plan()`` and
under ``Plan(invariant=MODE)`` (default ``"batch"``: the fast kernels with their orders pinned,
:mod:`functional_npu.models.batch_invariant`). Systems, each timed once per round, rounds interleaved:

- ``{dtype}_decode_b{1,8}_{on,off}``: greedy decode steps of a compiled model at that batch,
  ``B (N - 1) / (T(N) - T(1))`` tokens/s (:func:`benchmarks.timing.rates`, N = 16 new tokens);
- ``{dtype}_train_{on,off}``: one compiled train step (``lm_loss``, AdamW) on ``[8, 64]`` tokens, seconds.

Reported per dtype: the medians and spread over the rounds, and each round's on / off ratio (its median and spread).
Then where the extra time goes (``terms``): one profiled decode step at batches 1 and 8 and one train step, on and
off, the profiler's time in each class of extern kernel (:data:`CLASSES`: matmuls, batched matmuls, SDPA; the rest is
inductor's generated code, Python and the host), and each class's share of the on mode's extra time.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from functional_npu import Mesh, Plan, compile_model
from functional_npu.core import map_with_path
from functional_npu.models import embedded_config, family_of
from functional_npu.placement import place
from functional_npu.runtime.training import AdamW, compile_train_step, lm_loss

from .flags import count
from .timing import rates, ratio, rounds, seconds, stats

__all__ = ["main", "measure", "terms"]

NEW = 16
PROMPT = 8
BATCHES = (1, 8)
TRAIN_BATCH = (8, 64)
DTYPES = ("float32", "bfloat16")
# the profiler's op names by class: the extern kernels a compiled graph calls (inductor's own kernels and the host
# are the rest). On: ``mm`` holds the linears and the row sums (norms, log-softmax), ``bmm`` the row-parallel chunks,
# attention's key blocks and the experts; off: ``mm`` the linears of more than one row, ``sdpa`` attention.
CLASSES = {
    "mm": ("aten::mm", "aten::addmm"),
    "bmm": ("aten::bmm",),
    "sdpa": ("scaled_dot_product", "flash_attention"),
    "portable ops": ("functional_npu::invariant",),
}


def _params(cfg: Any, invariant: bool | str, dtype: str) -> dict:
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = family_of(cfg).init_params(cfg, seed=0)
    wide = getattr(torch, dtype)
    params = map_with_path(lambda p, x: x.to(wide) if x.is_floating_point() else x, params)
    return params.placed(place(cfg, mesh, Plan(invariant=invariant)))


def _decoder(cfg: Any, invariant: bool | str, dtype: str, batch: int):
    mesh = Mesh.abstract({"tp": 1}, 0)
    model = compile_model(
        _params(cfg, invariant, dtype), mesh, backend="inductor", batch_sizes=[batch],
        max_seq_len=PROMPT + NEW + 8, prefill_lengths=[PROMPT],
    )  # fmt: skip
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(PROMPT)] for i in range(batch)]

    def run(b: int, new: int) -> Any:
        return model.generate(prompts[:b], new)

    return run


def _trainer(cfg: Any, invariant: bool | str, dtype: str):
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = _params(cfg, invariant, dtype)
    step = compile_train_step(lm_loss, AdamW(lr=1e-4), params, mesh, backend="inductor")
    state = step.init(params)
    tokens = torch.randint(0, cfg.vocab_size, TRAIN_BATCH, generator=torch.Generator().manual_seed(0))

    def run() -> float:
        t = time.perf_counter()
        step(params, state, tokens)
        return time.perf_counter() - t

    return run


def _classify(name: str) -> str:
    return next((c for c, keys in CLASSES.items() if any(k in name for k in keys)), "")


def terms(run: Any) -> dict[str, float]:
    """Milliseconds of one call of ``run()`` by op class (:data:`CLASSES`, the profiler's CPU time of each class's
    top-level ops) and ``"rest"`` (the wall time less those: compiled code, Python, the host)."""
    from torch.profiler import ProfilerActivity, profile

    run()  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        run()
        wall = (time.perf_counter() - t) * 1e3
    out = dict.fromkeys(CLASSES, 0.0)
    for ev in prof.events():
        cls = _classify(ev.name)
        parent = ev.cpu_parent
        while cls and parent is not None:  # count an op once, at its outermost classified call
            if _classify(parent.name) == cls:
                cls = ""
            parent = parent.cpu_parent
        if cls:
            out[cls] += ev.cpu_time_total / 1e3
    out["rest"] = max(0.0, wall - sum(out.values()))
    return out


def measure(cfg: Any, mode: str, dtype: str, repeat: int) -> dict[str, Any]:
    """Build (compile and warm) every system of ``dtype``, then ``repeat`` interleaved rounds, then the terms."""
    systems, built, decoders, trainers = {}, {}, {}, {}
    for invariant, tag in ((mode, "on"), (False, "off")):
        for b in BATCHES:
            t = time.perf_counter()
            run = _decoder(cfg, invariant, dtype, b)
            rates(run, b, NEW, PROMPT)  # compiles prefill and decode
            built[f"decode_b{b}_{tag}"] = time.perf_counter() - t
            systems[f"decode_b{b}_{tag}"] = lambda run=run, b=b: rates(run, b, NEW, PROMPT)[0]
            decoders.setdefault(b, {})[tag] = run
        t = time.perf_counter()
        train = _trainer(cfg, invariant, dtype)
        train()
        built[f"train_{tag}"] = time.perf_counter() - t
        systems[f"train_{tag}"] = trainers[tag] = train
    got = rounds(systems, repeat, warmup=1)
    out: dict[str, Any] = {"build_s": built, "systems": {name: stats(v) for name, v in got.items()}, "ratios": {}}
    for b in BATCHES:  # tokens/s: off over on is the slowdown
        out["ratios"][f"decode_b{b}_off_over_on"] = ratio(got[f"decode_b{b}_off"], got[f"decode_b{b}_on"])
    out["ratios"]["train_on_over_off"] = ratio(got["train_on"], got["train_off"])
    out["terms"] = {}
    profiled = {  # a decode call of 2 tokens: a prefill and one step
        f"decode_b{b}_step": {tag: (lambda r=r, b=b: r(b, 2)) for tag, r in decoders[b].items()} for b in BATCHES
    }
    for name, runs in (profiled | {"train_step": trainers}).items():
        on, off = terms(runs["on"]), terms(runs["off"])
        extra = sum(on.values()) - sum(off.values())
        share = {c: (on[c] - off[c]) / extra if extra > 0 else None for c in on}
        out["terms"][name] = {"on_ms": on, "off_ms": off, "share_of_extra": share}
    return out


def table(result: dict[str, Any]) -> str:
    s, r = result["systems"], result["ratios"]
    rows = ["| system | mode on | mode off | cost (round by round) |", "|---|---|---|---|"]
    for b in BATCHES:
        on, off, c = s[f"decode_b{b}_on"], s[f"decode_b{b}_off"], r[f"decode_b{b}_off_over_on"]
        rows.append(
            f"| decode b{b}, tok/s | {on['median']:.1f} ({on['min']:.1f}-{on['max']:.1f}) | {off['median']:.1f} "
            f"({off['min']:.1f}-{off['max']:.1f}) | {c['median']:.2f}x slower ({c['min']:.2f}-{c['max']:.2f}) |"
        )
    on, off, c = s["train_on"], s["train_off"], r["train_on_over_off"]
    rows.append(
        f"| train step {TRAIN_BATCH[0]}x{TRAIN_BATCH[1]}, ms | {on['median'] * 1e3:.0f} ({on['min'] * 1e3:.0f}-"
        f"{on['max'] * 1e3:.0f}) | {off['median'] * 1e3:.0f} ({off['min'] * 1e3:.0f}-{off['max'] * 1e3:.0f}) | "
        f"{c['median']:.2f}x ({c['min']:.2f}-{c['max']:.2f}) |"
    )
    head = "| where the extra time goes | " + " | ".join([*CLASSES, "rest"]) + " |"
    rows += ["", head, "|---" * (len(CLASSES) + 2) + "|"]
    for name, t in result["terms"].items():
        cells = []
        for c in [*CLASSES, "rest"]:
            share = t["share_of_extra"][c]
            cells.append(f"{t['on_ms'][c]:.2f} / {t['off_ms'][c]:.2f}" + (f" ({share:.0%})" if share else ""))
        rows.append(f"| {name}: on / off ms (share of the extra) | " + " | ".join(cells) + " |")
    return "\n".join(rows)


KERNEL_SHAPES = ((1, 4096, 256), (8, 4096, 256), (8, 1536, 256), (512, 1536, 256))  # rows, out, in: the demo's


def kernels(repeat: int) -> list[dict[str, Any]]:
    """The invariant linear at the demo model's shapes (a decode step's rows and a training forward's): as the op runs
    it (its aten sequence), the same function compiled by inductor (the same bits, checked here), and torch's matmul;
    milliseconds, median of ``repeat`` interleaved rounds of 10 calls."""
    from functional_npu.models import invariant

    out = []
    for rows, n, k in KERNEL_SHAPES:
        x, w = torch.randn(rows, k), torch.randn(n, k)
        fused = torch.compile(invariant.linear, dynamic=False, options=invariant.INDUCTOR_OPTIONS)
        same = torch.equal(fused(x, w), invariant.linear(x, w))

        def timed(fn: Any) -> Any:
            return lambda: seconds(lambda: [fn(x, w) for _ in range(10)]) / 10 * 1e3

        systems = {"eager": timed(invariant.linear), "inductor": timed(fused), "matmul": timed(lambda a, b: a @ b.T)}
        got = rounds(systems, repeat, warmup=1)
        out.append({"shape": [rows, n, k], "same_bits": same} | {name: stats(v) for name, v in got.items()})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks invariant", description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("batch", "portable"), default="batch", help="the invariant mode (default batch)")
    p.add_argument("--dtype", nargs="+", choices=DTYPES, default=list(DTYPES), help="dtypes (default both)")
    p.add_argument("--quick", action="store_true", help="the small model (hidden 128, vocab 512)")
    p.add_argument("--repeat", type=count, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--append", action="store_true", help="add this run to the file's runs")
    p.add_argument("--kernels", action="store_true", help="the invariant linear alone (eager, inductor, matmul)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.kernels:
        print("| rows x out x in | the op (eager aten), ms | inductor, ms | matmul, ms | same bits |")
        print("|---|---|---|---|---|")
        for r in kernels(args.repeat):
            e, i, m = (r[name]["median"] for name in ("eager", "inductor", "matmul"))
            print(f"| {' x '.join(map(str, r['shape']))} | {e:.3f} | {i:.3f} | {m:.3f} | {r['same_bits']} |")
        return 0
    hf = embedded_config("small" if args.quick else "demo")
    cfg = family_of(hf["architectures"][0]).from_hf(hf)
    path = Path(args.json) if args.json else None
    if path is not None and not path.parent.is_dir():
        p.error(f"--json {args.json}: no directory {str(path.parent)!r} to write it in")
    results = {}
    for dtype in args.dtype:
        results[dtype] = measure(cfg, args.mode, dtype, args.repeat)
        print(f"\nPlan(invariant={args.mode!r}) against Plan(), {cfg.architecture}-style "
              f"{'small' if args.quick else 'demo'} model, {dtype}, inductor, {torch.get_num_threads()} threads, "
              f"{args.repeat} rounds (median (min-max))\n")  # fmt: skip
        print(table(results[dtype]))
    if path is not None:
        command = f"python -m benchmarks invariant --mode {args.mode}" + (" --quick" if args.quick else "")
        model = {"hidden": cfg.hidden_size, "layers": cfg.num_layers, "vocab": cfg.vocab_size}
        host = platform.processor() or platform.machine()
        run = {"command": command, "mode": args.mode, "model": model, "host": host, "threads": torch.get_num_threads()}
        old = json.loads(path.read_text()) if args.append and path.exists() else {"runs": []}
        old["runs"].append(run | {"dtypes": results})
        path.write_text(json.dumps(old, indent=1) + "\n")
    return 0
