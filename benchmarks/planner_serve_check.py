"""The serving planner against measurement: each candidate's batch sized from a per-rank memory budget by the
library, its served decode tokens/s measured on 4 gloo ranks, and the planner's ranking of them.

    python -m benchmarks planner_serve [--budgets 90,400] [--context 256] [--new 8] [--rounds 3]
        [--json benchmarks/results/planner_serve.json [--append]]

For each budget (MB per rank) and each of the planner's candidates for 4 devices listed in :data:`CHOSEN` (the
bench model, :data:`benchmarks.configs.QUICK`, and a small Qwen3-MoE, :func:`moe_config`):
:func:`~functional_npu.runtime.planning.serve_estimate` on this machine's profile (measured now, with 4 ranks, from
microbenchmarks only: no candidate below is used to fit it) gives the batch the budget admits (decode alone,
``context`` positions per sequence, at most ``--max-seqs``) and its predicted tokens/s. Every candidate is then
loaded, compiled with inductor for that batch and timed on 4 local gloo ranks in interleaved rounds: served
tokens/s is ``batch (N - 1) / (T(N) - T(1))`` on the slowest rank. At the end each rank counts what it holds
(params, KV cache and ring, by storage) against the budget. The report: per budget and model, each candidate's
batch, predicted and measured tokens/s (median and spread), the model's error, Kendall's tau between the predicted
and measured rankings, and how far the planner's choice is from the best measured candidate.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from functional_npu import compile_model, load_checkpoint
from functional_npu.models import dense, family_of, moe
from functional_npu.parallel import dp_axes, resident_bytes
from functional_npu.runtime import LocalWorld
from functional_npu.runtime.loading import save_checkpoint
from functional_npu.runtime.planning import Workload, candidates, host_device, serve_estimate
from functional_npu.runtime.serving import Lockstep, cache_length

from . import timing
from .configs import QUICK
from .flags import count, positives
from .planner_check import kendall_tau

WORLD = 4
PROMPT = 8
CHOSEN = {
    "dense": (
        "dp 4 x tp 1",
        "dp 2 x tp 2",
        "dp 1 x tp 4",
        "dp 4 x tp 1, lm_head TP 4",
        "dp 4 x tp 1, mlp TP 4",
        "dp 4 x tp 1, all modules TP 4",
        "dp 4 x tp 1, o_proj,down_proj layer-sharded over dp",
        "dp 4 x tp 1, layer layer-sharded over dp",
    ),
    "moe": ("dp 4 x tp 1", "dp 4 x tp 1, EP 4", "dp 2 x tp 2, EP 4", "dp 1 x tp 4"),
}


def moe_config() -> moe.MoeConfig:
    """A small Qwen3-MoE: the bench model's attention, 8 experts of 384 per layer, 2 per token."""
    return moe.MoeConfig(
        architecture="Qwen3MoeForCausalLM",
        **dense.dense_fields(QUICK),
        num_experts=8,
        top_k=2,
        moe_intermediate_size=384,
        norm_topk_prob=True,
        moe_layers=tuple(range(QUICK.num_layers)),
    )


def sized(cfg: Any, names: tuple[str, ...], device: Any, work: Workload, memory: float) -> dict[str, Any]:
    """The candidates named, each with the batch the planner admits under ``memory`` and its prediction (those that
    serve no sequence, or that the planner would not rank, are left out with why)."""
    by_name = {c.name: c for c in candidates(cfg, WORLD)}
    out = {}
    for name in names:
        try:
            s = serve_estimate(cfg, by_name[name], device, work, memory_per_device=memory)
        except ValueError as e:
            out[name] = {"skipped": " ".join(str(e).split())}
            continue
        out[name] = {"served": s} if s.batch else {"skipped": "serves no sequence in the budget"}
    return out


def _rank(ctx, path: str, plans: dict[str, tuple], context: int, new: int, rounds: int) -> dict:
    """Build every plan at its batch, count what each rank holds, then time them interleaved."""
    runs, held = {}, {}
    for name, (candidate, batch) in plans.items():
        mesh = ctx.mesh(candidate.axes)
        data = dp_axes(mesh, candidate.plan.tp)
        dp, me = mesh.axis_size(data), mesh.axis_index(data)
        mine = [[1 + i % 100, 2, 3, 4, 5, 6, 7, 8] for i in range(batch) if i % dp == me]
        per_rank = -(-batch // dp)
        lock = Lockstep(1, per_rank, PROMPT)
        params = load_checkpoint(path, mesh, candidate.plan)
        model = compile_model(
            params, mesh, backend="inductor", batch_sizes=[per_rank], max_seq_len=cache_length(context),
            prefill_lengths=[PROMPT],
        )  # fmt: skip
        runs[name] = lambda n, m=model, p=mine, lk=lock: m.generate(p, n, lockstep=lk)
        runs[name](new), runs[name](1)  # compile both graphs, warm the collectives
        state = model.new_state(per_rank)
        held[name] = resident_bytes(params.tree)
        held[name] += resident_bytes(list(state.kv)) + resident_bytes(list(state.prefetched))
        del state
    times = timing.rounds(
        {name: functools.partial(timing.generate_times, run, new) for name, run in runs.items()}, rounds
    )
    return {"times": times, "held": held}


def measure(cfg: Any, names: tuple[str, ...], memory: float, args: argparse.Namespace, device: Any) -> dict:
    work = Workload.serve(args.context, max_seqs=args.max_seqs, dtype=torch.float32)
    sizes = sized(cfg, names, device, work, memory)
    plans = {n: (v["served"].candidate, v["served"].batch) for n, v in sizes.items() if "served" in v}
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(family_of(cfg).init_params(cfg, seed=0), tmp)
        with LocalWorld(WORLD, timeout=3600) as world:
            ranks = world.run(_rank, tmp, plans, args.context, args.new, args.rounds)
    rows = {}
    for name, (_, batch) in plans.items():
        steps = [max(r["times"][name][i][0] - r["times"][name][i][1] for r in ranks) for i in range(args.rounds)]
        rate = [batch * (args.new - 1) / max(s, 1e-9) for s in steps]
        predicted = sizes[name]["served"].tokens_per_s
        rows[name] = {
            "batch": batch,
            "predicted_tokens_per_s": predicted,
            "measured_tokens_per_s": timing.stats(rate),
            "model_error": predicted / statistics.median(rate) - 1,
            "held_bytes": max(r["held"][name] for r in ranks),
            "within_budget": max(r["held"][name] for r in ranks) <= memory,
            "predicted_bytes": sizes[name]["served"].bytes,
        }
    return _summary(rows, memory) | {"skipped": {n: v["skipped"] for n, v in sizes.items() if "skipped" in v}}


def _summary(rows: dict[str, dict], memory: float) -> dict:
    names = list(rows)
    predicted = [rows[n]["predicted_tokens_per_s"] for n in names]
    measured = [rows[n]["measured_tokens_per_s"]["median"] for n in names]
    chosen = names[max(range(len(names)), key=lambda i: predicted[i])]
    return {
        "memory_mb": memory / 1e6,
        "plans": rows,
        "kendall_tau": kendall_tau(predicted, measured) if len(names) > 1 else None,
        "chosen": chosen,
        "best_measured": names[max(range(len(names)), key=lambda i: measured[i])],
        "chosen_vs_best_measured": rows[chosen]["measured_tokens_per_s"]["median"] / max(measured) - 1,
    }


def table(model: str, r: dict) -> str:
    lines = [
        f"{model}, {r['memory_mb']:.0f} MB per rank",
        "",
        "| plan | batch | predicted tok/s | measured tok/s (median, spread) | model error | held / budget |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in r["plans"].items():
        m = row["measured_tokens_per_s"]
        lines.append(
            f"| {name} | {row['batch']} | {row['predicted_tokens_per_s']:.0f} | {m['median']:.0f} "
            f"({m['min']:.0f}-{m['max']:.0f}) | {row['model_error']:+.0%} | "
            f"{row['held_bytes'] / 1e6:.1f} / {r['memory_mb']:.0f} MB |"
        )
    tau = "n/a" if r["kendall_tau"] is None else f"{r['kendall_tau']:.2f}"
    lines.append(
        f"\nKendall tau {tau}; the planner's choice {r['chosen']!r} is {r['chosen_vs_best_measured']:+.1%} from "
        f"the best measured ({r['best_measured']!r})"
    )
    lines += [f"- skipped {n}: {why}" for n, why in r["skipped"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks planner_serve", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budgets", type=positives, default=[90.0, 400.0], help="memory per rank in MB, comma-separated"
    )
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--max-seqs", type=int, default=64)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--rounds", type=count, default=3)
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--append", action="store_true", help="add this run to FILE's runs")
    args = parser.parse_args(argv)
    device = host_device(WORLD, refresh=True)
    configs = {"dense": QUICK, "moe": moe_config()}
    result: dict[str, Any] = {"context": args.context, "new": args.new, "rounds": args.rounds, "cells": []}
    for model in args.models.split(","):
        for mb in args.budgets:
            r = measure(configs[model], CHOSEN[model], mb * 1e6, args, device)
            print(table(model, r) + "\n", flush=True)
            result["cells"].append({"model": model} | r)
    if args.json:
        path = Path(args.json)
        runs = json.loads(path.read_text())["runs"] if args.append and path.is_file() else []
        path.write_text(json.dumps({"runs": runs + [result]}, indent=1, default=str) + "\n")
    return 0
