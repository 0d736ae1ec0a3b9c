"""The serving planner against what the engine serves: each plan under one memory budget per rank, its served
tokens/s predicted by the planner and measured through the request engine on gloo ranks.

    python -m benchmarks planner_engine [--budget 330] [--context 128] [--prompt 32] [--max-seqs 16] [--rounds 3]
        [--json benchmarks/results/planner_engine.json [--append]]

The bench model (:data:`benchmarks.configs.QUICK`) in fp32 on :data:`WORLD` gloo ranks, for each plan of
:data:`CHOSEN`:

- **predicted**: :func:`~functional_npu.runtime.planning.serve_estimate` on this machine's profile (measured now from
  microbenchmarks, nothing below fitted to it) for a serving workload of ``context`` positions per sequence, a
  prompt share of ``prompt / context``, at most ``max-seqs`` sequences: the batch the budget admits and the tokens/s
  (prompt and generated) it serves;
- **measured**: the plan loaded and compiled (inductor), an :class:`~functional_npu.runtime.serving.Engine` in
  lockstep over the ranks whose KV budget is what the rank's budget leaves after what it really holds (its params,
  counted by storage; the prefetch ring and the activations as the planner prices them): the engine's pool decides
  how many sequences run at once (at most ``max-seqs`` over the data-parallel ranks); it serves ``3 x`` that many
  requests of ``prompt`` tokens each per data-parallel rank, generating to the context (no stop id), timed on rank 0,
  rounds interleaved across plans. A plan with ``dp`` data-parallel ranks serves through engine replicas over them
  (``Engine(replicas=...)``: each dp rank runs requests of its own, in lockstep with the others), and its tokens/s is
  every replica's tokens over the wall time. Beside it, in the same rounds, the same plan with every rank running rank
  0's batch: its tokens/s times ``dp`` (what runs before engine replicas reported) is what the replicas would serve
  with no lockstep cost, and the ratio, round by round, is that cost.

The report: per plan the batch predicted and admitted, predicted and measured tokens/s (median and spread), the
model's error, what each rank held against the budget; and how far the planner's choice is from the best measured
plan (the target: within 10%).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from functional_npu import compile_model, load_checkpoint
from functional_npu.models import family_of
from functional_npu.parallel import dp_axes, resident_bytes
from functional_npu.runtime import LocalWorld
from functional_npu.runtime.loading import save_checkpoint
from functional_npu.runtime.planning import Workload, candidates, host_device, serve_estimate
from functional_npu.runtime.serving import Engine, Request

from . import timing
from .configs import QUICK
from .flags import count
from .planner_check import kendall_tau

WORLD = 2
CHOSEN = (
    "dp 1 x tp 2",
    "dp 2 x tp 1",
    "dp 2 x tp 1, mlp TP 2",
    "dp 2 x tp 1, all modules TP 2",
    "dp 2 x tp 1, o_proj,down_proj layer-sharded over dp",
)
BLOCK = 16
ONE_BATCH = "one batch: "  # the key of a dp plan run with every rank on rank 0's batch


def predicted(cfg: Any, device: Any, work: Workload, memory: float) -> dict[str, Any]:
    """Each chosen plan's :class:`~functional_npu.runtime.planning.Served` under ``memory`` per rank."""
    by_name = {c.name: c for c in candidates(cfg, WORLD)}
    return {name: serve_estimate(cfg, by_name[name], device, work, memory_per_device=memory) for name in CHOSEN}


def _engine(
    ctx: Any, path: str, served: Any, memory: float, args: argparse.Namespace, replicated: bool = True
) -> tuple[Engine, int, dict]:
    """The plan's engine on this rank: its KV budget what ``memory`` leaves after the params held, the planner's
    ring and activations; its batch the most sequences that pool holds (at most the plan's share of max-seqs).
    ``replicated``: its dp ranks are replicas serving requests of their own; else every rank runs rank 0's batch."""
    candidate = served.candidate
    mesh = ctx.mesh(candidate.axes)
    dp = mesh.axis_size(dp_axes(mesh, candidate.plan.tp))
    params = load_checkpoint(path, mesh, candidate.plan)
    held = resident_bytes(params.tree)
    kv_bytes = int(memory - held - served.bytes["prefetch"] - served.bytes["activations"])
    rows = max(1, args.max_seqs // dp)

    def build(rows: int) -> Engine:
        model = compile_model(params, mesh, backend="inductor", batch_sizes=[rows], max_seq_len=args.context,
                              prefill_lengths=[args.prompt])  # fmt: skip
        replicas = dp_axes(mesh, candidate.plan.tp) if dp > 1 and replicated else None
        return Engine(model, kv_bytes=kv_bytes, block_size=BLOCK, chunk=args.prompt, stop=(), lockstep=True,
                      replicas=replicas)  # fmt: skip

    engine = build(rows)
    fits = (engine.pool.size - 1) // math.ceil(args.context / BLOCK)
    if fits < rows:  # the pool holds fewer sequences than the bucket: the batch is the pool's
        engine = build(max(1, fits))
    return engine, dp, {"params": held, "kv_pool": engine.kv_bytes_used, "kv_budget": kv_bytes}


def _serve(engine: Engine, n: int, args: argparse.Namespace) -> tuple[float, int]:
    """Rank 0: serve ``n`` requests; (seconds, tokens served: prompt and generated). The others follow."""
    if torch.distributed.get_rank() != 0:
        engine.follow()
        return 0.0, 0
    reqs = [Request(tuple(1 + (i + j) % 100 for j in range(args.prompt)), args.context - args.prompt, stop=())
            for i in range(n)]  # fmt: skip
    start = time.perf_counter()
    tokens = sum(len(e.tokens) for e in engine.run(reqs))
    seconds = time.perf_counter() - start
    engine.close()
    return seconds, tokens + n * args.prompt


def _rank(ctx: Any, path: str, served: dict, memory: float, args: argparse.Namespace) -> dict:
    engines = {name: _engine(ctx, path, s, memory, args) for name, s in served.items()}
    for engine, _, _ in engines.values():  # compile the decode and the chunk's graphs, warm the collectives
        _serve(engine, 2, args)
    runs = {name: (lambda e=e, dp=dp: _serve(e, 3 * max(e.model.batch_sizes) * dp, args))
            for name, (e, dp, _) in engines.items()}  # fmt: skip
    # beside each dp plan, the same plan with every rank running rank 0's batch (what ran before engine replicas):
    # its tokens times dp is what the replicas would serve with no lockstep cost
    single = {name: _engine(ctx, path, served[name], memory, args, replicated=False)[0]
              for name, (_, dp, _) in engines.items() if dp > 1}  # fmt: skip
    for name, engine in single.items():
        _serve(engine, 2, args)
        runs[ONE_BATCH + name] = lambda e=engine: _serve(e, 3 * max(e.model.batch_sizes), args)
    times = timing.rounds(runs, args.rounds)
    held = {}
    for name, (_, _, counted) in engines.items():  # the ring as the planner prices it (k + 1 slots of one layer)
        ring = served[name].bytes["prefetch"]
        held[name] = counted | {"ring": ring, "total": counted["params"] + counted["kv_pool"] + ring}
    return {
        "times": times,
        "held": held,
        "rows": {name: max(e.model.batch_sizes) for name, (e, _, _) in engines.items()},
        "dp": {name: dp for name, (_, dp, _) in engines.items()},
    }


def measure(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    memory = args.budget * 1e6
    work = Workload.serve(args.context, args.prompt / args.context, max_seqs=args.max_seqs, dtype=torch.float32)
    served = predicted(QUICK, device, work, memory)
    fitting = {name: s for name, s in served.items() if s.batch}
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(family_of(QUICK).init_params(QUICK, seed=0), tmp)
        with LocalWorld(WORLD, timeout=3600, pg_timeout=600) as world:
            ranks = world.run(_rank, tmp, fitting, memory, args)
    first = ranks[0]
    rows = {}
    for name, s in fitting.items():
        dp = first["dp"][name]
        rates = [tokens / seconds for seconds, tokens in first["times"][name]]  # every replica's tokens
        held = max(r["held"][name]["total"] for r in ranks)
        one = first["times"].get(ONE_BATCH + name)
        ideal = [dp * tokens / seconds for seconds, tokens in one] if one else None  # one batch's tokens times dp
        rows[name] = {
            "batch_predicted": s.batch,
            "batch_admitted": first["rows"][name] * dp,
            "predicted_tokens_per_s": s.tokens_per_s,
            "measured_tokens_per_s": timing.stats(rates),
            "model_error": s.tokens_per_s / statistics.median(rates) - 1,
            "held": [r["held"][name] for r in ranks],
            "within_budget": held <= memory,
            "predicted_bytes": s.bytes,
            "one_batch_times_dp": timing.stats(ideal) if ideal else None,
            "replicas_over_one_batch_times_dp": timing.stats([a / b for a, b in zip(rates, ideal)]) if ideal else None,
        }
    names = list(rows)
    pred = [rows[n]["predicted_tokens_per_s"] for n in names]
    meas = [rows[n]["measured_tokens_per_s"]["median"] for n in names]
    chosen = names[max(range(len(names)), key=lambda i: pred[i])]
    return {
        "memory_mb": args.budget,
        "plans": rows,
        "skipped": [n for n in served if n not in fitting],
        "kendall_tau": kendall_tau(pred, meas),
        "chosen": chosen,
        "best_measured": names[max(range(len(names)), key=lambda i: meas[i])],
        "chosen_vs_best_measured": rows[chosen]["measured_tokens_per_s"]["median"] / max(meas) - 1,
        "median_abs_error": statistics.median(abs(rows[n]["model_error"]) for n in names),
    }


def table(r: dict) -> str:
    lines = [
        f"{r['memory_mb']:.0f} MB per rank",
        "",
        "| plan | batch predicted / admitted | predicted tok/s | measured tok/s (median, spread) | model error | "
        "held / budget (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in r["plans"].items():
        m = row["measured_tokens_per_s"]
        held = max(h["total"] for h in row["held"]) / 1e6
        lines.append(
            f"| {name} | {row['batch_predicted']} / {row['batch_admitted']} | {row['predicted_tokens_per_s']:.0f} | "
            f"{m['median']:.0f} ({m['min']:.0f}-{m['max']:.0f}) | {row['model_error']:+.0%} | "
            f"{held:.0f} / {r['memory_mb']:.0f} |"
        )
    ratios = {n: row["replicas_over_one_batch_times_dp"] for n, row in r["plans"].items()}
    lines += [
        f"- {name}: replicas serve {x['median']:.2f}x ({x['min']:.2f}-{x['max']:.2f}) one batch's tokens/s times dp"
        for name, x in ratios.items()
        if x
    ]
    lines.append(
        f"\nKendall tau {r['kendall_tau']:.2f}; median |error| {r['median_abs_error']:.0%}; the planner's choice "
        f"{r['chosen']!r} is {r['chosen_vs_best_measured']:+.1%} from the best measured ({r['best_measured']!r})"
    )
    lines += [f"- skipped (serves no sequence in the budget): {n}" for n in r["skipped"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks planner_engine", description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=330.0, help="memory per rank, MB")
    parser.add_argument("--context", type=int, default=128, help="positions per sequence (prompt and generated)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request (the prefill chunk)")
    parser.add_argument("--max-seqs", type=int, default=16, help="sequences served at once, over all dp ranks")
    parser.add_argument("--rounds", type=count, default=3)
    parser.add_argument("--json", metavar="FILE", help="write the result here (--append: add it to FILE's runs)")
    parser.add_argument("--append", action="store_true")
    args = parser.parse_args(argv)
    if not 0 < args.prompt < args.context:
        parser.error(f"--prompt {args.prompt} must be between 1 and --context {args.context} - 1")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        parser.error(f"--json {args.json}: its folder does not exist")
    r = measure(args, host_device(WORLD, refresh=True))
    print(table(r), flush=True)
    if args.json:
        path = Path(args.json)
        runs = json.loads(path.read_text())["runs"] if args.append and path.is_file() else []
        path.write_text(json.dumps({"runs": runs + [r]}, indent=1, default=str) + "\n")
    return 0
