"""What keeping weight series in host memory costs on this host: decode tokens/s with o_proj and down_proj in host
memory at prefetch steps 0, 1 and 2, against the resident model.

    python -m benchmarks offload [--quick] [--repeat N] [--json FILE [--append]]

One process, one rank, float32, compiled with inductor: the benchmarks' 70.5M-parameter Qwen3-style model
(:data:`benchmarks.configs.FULL`, 12 layers; ``--quick``: :data:`~benchmarks.configs.QUICK`, 4 layers) with seeded
weights, resident (``Plan()``) and with ``Plan(offload="o_proj,down_proj", prefetch_step=k)``. Every offloaded model's
greedy tokens are checked equal to the resident model's before timing. Systems, each timed once per round, rounds
interleaved: ``b{1,8}_resident`` and ``b{1,8}_offload_k{0,1,2}``, ``B (N - 1) / (T(N) - T(1))`` decode tokens/s
(N = 16 new tokens). Reported: medians and spread, and each round's resident / offloaded ratio.

On a CPU host the "host link" is a memcpy on the cores that compute (no copy engine, one memory): every layer's copy
is exposed whatever ``k`` is, and the figure is that copy's price, not an emulation of a device's link. A device's
host link is measured by ``python -m benchmarks gpu`` (``host_link``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from functional_npu import Mesh, Plan, compile_model
from functional_npu.models import family_of
from functional_npu.placement import place

from .configs import FULL, QUICK
from .timing import rates, ratio, rounds, stats

__all__ = ["main", "measure"]

NEW = 16
PROMPT = 8
BATCHES = (1, 8)
STEPS = (0, 1, 2)
SERIES = "o_proj,down_proj"


def _decoder(cfg: Any, plan: Plan, batch: int):
    """A compiled model of ``cfg`` under ``plan`` (its host series split off the seeded full params) and its run."""
    from functional_npu.parallel import stack_host

    mesh = Mesh.abstract({"tp": 1}, 0)
    placed = place(cfg, mesh, plan)
    params = family_of(cfg).init_params(cfg, seed=0)
    if placed.plan.offload:
        params = stack_host(params, placed.plan.offload)
    model = compile_model(
        params | {"placement": placed}, mesh, backend="inductor", batch_sizes=[batch],
        max_seq_len=PROMPT + NEW + 8, prefill_lengths=[PROMPT],
    )  # fmt: skip
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(PROMPT)] for i in range(batch)]

    def run(b: int, new: int) -> Any:
        return model.generate(prompts[:b], new)

    return run


def measure(cfg: Any, repeat: int) -> dict[str, Any]:
    """Build (compile, warm, check tokens) every system, then ``repeat`` interleaved rounds."""
    systems, built, ratios = {}, {}, {}
    plans = {"resident": Plan()} | {f"offload_k{k}": Plan(offload=SERIES, prefetch_step=k) for k in STEPS}
    for b in BATCHES:
        reference = None
        for tag, plan in plans.items():
            t = time.perf_counter()
            run = _decoder(cfg, plan, b)
            tokens = run(b, NEW)
            if reference is None:
                reference = tokens
            elif tokens != reference:
                raise AssertionError(f"{tag} at batch {b}: tokens differ from the resident model's")
            rates(run, b, NEW, PROMPT)
            built[f"b{b}_{tag}"] = time.perf_counter() - t
            systems[f"b{b}_{tag}"] = lambda run=run, b=b: rates(run, b, NEW, PROMPT)[0]
    got = rounds(systems, repeat, warmup=1)
    for b in BATCHES:
        for k in STEPS:
            ratios[f"b{b}_resident_over_offload_k{k}"] = ratio(got[f"b{b}_resident"], got[f"b{b}_offload_k{k}"])
    return {"build_s": built, "systems": {n: stats(v) for n, v in got.items()}, "ratios": ratios, "tokens_equal": True}


def table(result: dict[str, Any]) -> str:
    s, r = result["systems"], result["ratios"]
    rows = ["| batch | resident tok/s | " + " | ".join(f"offload k={k}: tok/s (cost)" for k in STEPS) + " |"]
    rows.append("|---" * (2 + len(STEPS)) + "|")
    for b in BATCHES:
        res = s[f"b{b}_resident"]
        cols = []
        for k in STEPS:
            o, c = s[f"b{b}_offload_k{k}"], r[f"b{b}_resident_over_offload_k{k}"]
            cols.append(f"{o['median']:.1f} ({c['median']:.2f}x, {c['min']:.2f}-{c['max']:.2f})")
        rows.append(f"| {b} | {res['median']:.1f} ({res['min']:.1f}-{res['max']:.1f}) | " + " | ".join(cols) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks offload", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the 4-layer model")
    p.add_argument("--repeat", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--json", metavar="FILE", help="write the result here")
    p.add_argument("--append", action="store_true", help="add this run to the JSON's runs")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    result = measure(cfg, args.repeat)
    result |= {"model": "QUICK" if args.quick else "FULL", "series": SERIES, "host": platform.node()}
    print(table(result))
    if args.json:
        path = Path(args.json)
        runs = json.loads(path.read_text())["runs"] if args.append and path.exists() else []
        command = "python -m benchmarks offload --json " + args.json + (" --quick" if args.quick else "")
        path.write_text(json.dumps({"command": command, "runs": runs + [result]}, indent=1) + "\n")
    return 0
