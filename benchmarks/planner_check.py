"""The planner against measurement: its ranking of candidate plans of the bench model on 4 gloo ranks, and
the decode step each one really takes.

    python -m benchmarks planner [--quick] [--backend inductor|none] [--batch 8] [--new 12] [--rounds 5]
        [--json benchmarks/results/planner.json [--append]]

Seven of the planner's own candidates for 4 devices (plain DP, tp 2 and 4, lm_head and mlp TP over the dp
ranks, o_proj/down_proj layer-sharded at k = 1 and k = 2) are loaded and compiled on 4 local gloo ranks, then
timed in interleaved rounds (A B C ... A B C ...): the step is ``(T(N new) - T(1 new)) / (N - 1)`` on the slowest
rank. Each candidate's modelled step is :func:`functional_npu.runtime.planning.estimate` on this machine's profile
(:func:`functional_npu.runtime.planning.host_device`, measured now with 4 ranks). The report: each
candidate's measured median and spread, its modelled step and the model's error, Kendall's tau between the
modelled and the measured ranking, and how far the planner's choice is from the best measured plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import statistics
import tempfile
from pathlib import Path

import torch

from functional_npu import compile_model, load_checkpoint
from functional_npu.models.llama import init_params
from functional_npu.parallel import dp_axes
from functional_npu.runtime import LocalWorld
from functional_npu.runtime.loading import save_checkpoint
from functional_npu.runtime.planning import Candidate, Workload, candidates, estimate, host_device
from functional_npu.runtime.serving import Lockstep, cache_length

from . import timing
from .configs import FULL, QUICK
from .flags import count

WORLD = 4
PROMPT = 8
CHOSEN = (  # of the planner's candidates for 4 devices; "@k" fixes the layer shard's prefetch step
    "dp 4 x tp 1",
    "dp 2 x tp 2",
    "dp 1 x tp 4",
    "dp 4 x tp 1, lm_head TP 4",
    "dp 4 x tp 1, mlp TP 4",
    "dp 4 x tp 1, o_proj,down_proj layer-sharded over dp@1",
    "dp 4 x tp 1, o_proj,down_proj layer-sharded over dp@2",
)


def plans(cfg) -> dict[str, Candidate]:
    """The measured candidates, by name (the planner's own, with the layer shard's k fixed where named)."""
    by_name = {c.name: c for c in candidates(cfg, WORLD)}
    out = {}
    for name in CHOSEN:
        base, _, k = name.partition("@")
        c = by_name[base]
        if k:
            c = dataclasses.replace(c, name=f"{base}, k = {k}", plan=dataclasses.replace(c.plan, prefetch_step=int(k)))
        out[c.name] = c
    return out


def _rank(ctx, path: str, cfg, backend: str, batch: int, new: int, rounds: int) -> dict:
    """Build every plan, then time them interleaved: ``{plan: [(T(new), T(1)) per round]}``."""
    runs = {}
    for name, c in plans(cfg).items():
        mesh = ctx.mesh(c.axes)
        data = dp_axes(mesh, c.plan.tp)
        dp, me = mesh.axis_size(data), mesh.axis_index(data)
        mine = [[1 + i, 2, 3, 4, 5, 6, 7, 8] for i in range(batch) if i % dp == me]
        lock = Lockstep(1, len(mine), PROMPT)
        model = compile_model(
            load_checkpoint(path, mesh, c.plan),
            mesh,
            backend=backend,
            batch_sizes=[len(mine)],
            max_seq_len=cache_length(PROMPT + new),
            prefill_lengths=[PROMPT],
        )
        runs[name] = lambda n, m=model, p=mine, lk=lock: m.generate(p, n, lockstep=lk)
        runs[name](new), runs[name](1)  # compile both graphs, warm the collectives
    return timing.rounds(
        {name: functools.partial(timing.generate_times, run, new) for name, run in runs.items()}, rounds
    )


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a between two scorings of the same items."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    s = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs
    )
    return s / len(pairs)


def measure(cfg, *, backend: str, batch: int, new: int, rounds: int) -> dict:
    device = host_device(WORLD, refresh=True)
    work = Workload.decode(batch, PROMPT + new, torch.float32)
    chosen = plans(cfg)
    modelled = {name: estimate(cfg, c, device, work).step_s * 1e3 for name, c in chosen.items()}
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(init_params(cfg), tmp)
        with LocalWorld(WORLD, timeout=3600) as world:
            ranks = world.run(_rank, tmp, cfg, backend, batch, new, rounds)
    steps = {
        name: [max(r[name][i][0] - r[name][i][1] for r in ranks) / (new - 1) * 1e3 for i in range(rounds)]
        for name in chosen
    }
    names = list(chosen)
    measured = [statistics.median(steps[n]) for n in names]
    model = [modelled[n] for n in names]
    best_model = names[min(range(len(names)), key=lambda i: model[i])]
    best_measured = min(measured)
    rows = {
        n: {
            "measured_ms": timing.stats(steps[n]),
            "modelled_ms": modelled[n],
            "model_error": modelled[n] / statistics.median(steps[n]) - 1,
        }
        for n in names
    }
    return {
        "backend": backend,
        "batch": batch,
        "new": new,
        "rounds": rounds,
        "device": {
            "stream_GB_s": device.memory_bytes_per_s / 1e9,  # what decode linears stream at, per rank
            "flop_G_s": device.flop_per_s / 1e9,
            "collectives": {
                k: {"alpha_us": a * 1e6, "GB_s": 1 / b / 1e9 if b else None} for k, (a, b) in device.measured.items()
            },
        },
        "plans": rows,
        "kendall_tau": kendall_tau(model, measured),
        "chosen": best_model,
        "chosen_vs_best_measured": statistics.median(steps[best_model]) / best_measured - 1,
    }


def table(r: dict) -> str:
    lines = [
        "| plan | measured step (median, spread) | modelled | model error |",
        "|---|---|---|---|",
    ]
    for name, row in r["plans"].items():
        m = row["measured_ms"]
        lines.append(
            f"| {name} | {m['median']:.2f} ms ({m['min']:.2f}-{m['max']:.2f}) | {row['modelled_ms']:.2f} ms "
            f"| {row['model_error']:+.0%} |"
        )
    lines.append(
        f"\nKendall tau (modelled vs measured ranking): {r['kendall_tau']:.2f}; the planner's choice "
        f"{r['chosen']!r} is {r['chosen_vs_best_measured']:+.1%} from the best measured plan"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks planner", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 4-layer model (a smoke run)")
    parser.add_argument("--backend", default="inductor", choices=("inductor", "none"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new", type=int, default=12)
    parser.add_argument("--rounds", type=count, default=5)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--append", action="store_true", help="add this run to FILE's runs")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    result = measure(cfg, backend=args.backend, batch=args.batch, new=args.new, rounds=args.rounds)
    print(table(result))
    if args.json:
        path = Path(args.json)
        runs = json.loads(path.read_text())["runs"] if args.append and path.is_file() else []
        path.write_text(json.dumps({"runs": runs + [result]}, indent=1) + "\n")
    return 0
