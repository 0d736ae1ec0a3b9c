"""Module TP over data-parallel ranks: per-rank resident weight bytes and decode step time, plain DP vs each
module TP'd over both dp ranks vs all of them, on the same model in one run.

    python -m benchmarks module_tp [--quick] [--backend inductor|none] [--batch 4] [--new 16]
        [--rounds 5] [--json benchmarks/results/module_tp.json]

Two gloo ranks (dp = 2, tp = 1), each decoding its own batch; every plan is loaded and compiled first,
then ``--rounds`` rounds time each plan in turn (A B C ... A B C ...), so drift on a shared machine
hits all alike. The step time is ``(T(N new tokens) - T(1 new token)) / (N - 1)`` on the slowest rank;
the table gives each plan's median over the rounds, the spread (min to max) and the ratio to plain DP
from the same rounds. Resident bytes are the model's own params on rank 0 (after ``compile_model``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import tempfile
from pathlib import Path

from functional_npu import Plan, compile_model, flatten_with_paths, load_checkpoint, split_dp
from functional_npu.models.llama import init_params
from functional_npu.runtime import LocalWorld
from functional_npu.runtime.loading import save_checkpoint
from functional_npu.runtime.serving import Lockstep, cache_length

from . import timing
from .configs import FULL, QUICK
from .flags import count

PLANS = {
    "plain DP": {},
    "o_proj TP 2": {"o_proj": 2},
    "mlp TP 2": {"mlp": 2},
    "embed TP 2": {"embed": 2},
    "lm_head TP 2": {"lm_head": 2},
    "all four TP 2": {"o_proj": 2, "mlp": 2, "embed": 2, "lm_head": 2},
}
PROMPT = 8
# collectives a decode step adds over plain DP (the golden graph of the composed case shows them): o_proj's
# all_to_all + reduce-scatter and the MLP's all_gather + reduce-scatter per layer, two for each table
ADDED = {
    "o_proj": lambda layers: 2 * layers,
    "mlp": lambda layers: 2 * layers,
    "embed": lambda _: 2,
    "lm_head": lambda _: 2,
}


def _rank(ctx, path: str, backend: str, batch: int, new: int, rounds: int) -> dict:
    """Build every plan, then time them interleaved: ``{plan: {"bytes", "times": [(T(new), T(1)) per round]}}``."""
    prompts = [[1 + i + 7 * ctx.rank, 2, 3, 4, 5, 6, 7, 8] for i in range(batch)]
    lock = Lockstep(1, batch, PROMPT)
    runs, out = {}, {}
    for name, sizes in PLANS.items():
        axes, module_tp = split_dp({"dp": 2, "tp": 1}, sizes)
        mesh = ctx.mesh(axes)
        model = compile_model(
            load_checkpoint(path, mesh, Plan(module_tp=module_tp)),
            mesh,
            backend=backend,
            batch_sizes=[batch],
            max_seq_len=cache_length(PROMPT + new),
            prefill_lengths=[PROMPT],
        )
        runs[name] = lambda n, m=model: m.generate(prompts, n, lockstep=lock)
        runs[name](new), runs[name](1)  # compile both graphs, warm the collectives
        leaves = flatten_with_paths(model.params)
        out[name] = {"bytes": sum(x.numel() * x.element_size() for _, x in leaves)}
    times = timing.rounds(
        {name: functools.partial(timing.generate_times, run, new) for name, run in runs.items()}, rounds
    )
    return {name: out[name] | {"times": times[name]} for name in runs}


def measure(cfg, *, backend: str, batch: int, new: int, rounds: int) -> dict:
    """Every plan's resident bytes, step times (slowest rank per round) and their ratio to plain DP."""
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(init_params(cfg), tmp)
        with LocalWorld(2, timeout=3600) as world:
            ranks = world.run(_rank, tmp, backend, batch, new, rounds)
    plain = None
    result = {}
    for name in PLANS:
        steps = [  # slowest rank per round
            max(t_all - t_one for t_all, t_one in (r[name]["times"][i] for r in ranks)) / (new - 1) * 1e3
            for i in range(rounds)
        ]
        plain = steps if plain is None else plain
        added = sum(ADDED[m](cfg.num_layers) for m in PLANS[name])
        result[name] = {
            "plan": PLANS[name],
            "resident_bytes": ranks[0][name]["bytes"],
            "step_ms": timing.stats(steps),
            "step_vs_plain": timing.ratio(steps, plain)["median"],
            "added_collectives": added,
            "ms_per_added_collective": (
                statistics.median([s - p for s, p in zip(steps, plain)]) / added if added else None
            ),
        }
    return result


def table(result: dict) -> str:
    plain = result["plain DP"]["resident_bytes"]
    rows = [
        "| plan | resident weights per rank | vs plain DP | decode step (median, spread) | step vs plain DP "
        "| collectives added per step | step added per collective |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in result.items():
        s, per = r["step_ms"], r["ms_per_added_collective"]
        rows.append(
            f"| {name} | {r['resident_bytes'] / 2**20:.1f} MiB | {r['resident_bytes'] / plain:.2f}x | "
            f"{s['median']:.1f} ms ({s['min']:.1f}-{s['max']:.1f}) | {r['step_vs_plain']:.2f}x | "
            f"{r['added_collectives']} | {'-' if per is None else f'{per:.2f} ms'} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks module_tp", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 4-layer model")
    parser.add_argument("--backend", default="inductor", choices=["inductor", "none"])
    parser.add_argument("--batch", type=int, default=4, help="sequences per dp rank")
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--rounds", type=count, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    result = measure(cfg, backend=args.backend, batch=args.batch, new=args.new, rounds=args.rounds)
    print(table(result))
    if args.json:
        meta = {"config": dataclasses.asdict(cfg) | {"module_tp": None}, "args": vars(args)}
        Path(args.json).write_text(json.dumps({"meta": meta, "plans": result}, indent=1) + "\n")
