"""``python -m benchmarks NAME [flags]``: run one benchmark, from the repository root (``NAME -h``: its flags).

A SIGTERM stops the run cleanly (exit 143: local ranks stopped, temporary files removed), a Ctrl-C too, in one
line (exit 130).
"""

from __future__ import annotations

import importlib
import signal
import sys
from pathlib import Path
from typing import Any

# name -> (module of this package whose main(argv) runs it, what it measures)
COMMANDS = {
    "bench": ("scoreboard", "the scoreboard: this library vs transformers, eager and compiled (needs transformers)"),
    "linears": ("linears", "the linear kernels alone: matmul, streamed, oneDNN at batches 1, 8, 32"),
    "mla": ("bench_mla", "MLA: per-head vs latent KV cache, plain vs absorbed decode"),
    "module_tp": ("bench_module_tp", "module TP over dp ranks: resident bytes and decode step time per plan"),
    "prefetch": ("bench_prefetch", "layer-sharded decode with prefetch, on the loopback and an emulated link"),
    "prefetch_paper": ("prefetch_paper", "where layer sharding pays, on paper: the cost model on published figures"),
    "offload": ("bench_offload", "series kept in host memory: decode tok/s at k = 0, 1, 2 against the resident model"),
    "invariant": ("bench_invariant", "the invariant mode's cost: decode tok/s at batches 1, 8 and a train step"),
    "reshard": ("bench_reshard", "train-to-inference weight sync: reshard from Megatron TP=2 on 2 gloo ranks"),
    "weight_sync": (
        "bench_weight_sync",
        "weight sync in buckets of bounded memory on 2 and 4 gloo ranks, against one broadcast from rank 0",
    ),
    "shard": ("bench_shard", "throughput of shard and gather against a same-run memcpy"),
    "load": ("bench_load", "bytes each rank reads from a checkpoint, for tp = 1, 2, 4 (needs transformers)"),
    "eplb": ("bench_eplb", "bytes moved by an EPLB rebalance against moving every expert, and its time"),
    "moe": ("bench_moe", "MoE decode tokens/s on 2 gloo ranks: experts over both ranks vs replicated"),
    "planner": ("planner_check", "the planner's ranking of 7 plans on 4 gloo ranks against their measured decode step"),
    "planner_paper": ("planner_paper", "the planner's choice for Qwen3, Llama-3-70B and DeepSeek-V3 on 910B / 910C"),
    "planner_published": (
        "planner_published",
        "the step model against published deployments: a fixed cost per step fitted per profile, the rest held out",
    ),
    "planner_serve": (
        "planner_serve_check",
        "the serving planner on 4 gloo ranks: batches sized from a budget, measured",
    ),
    "planner_engine": (
        "planner_engine_check",
        "the serving planner against the request engine on 2 gloo ranks: 5 plans under one budget, served tokens/s",
    ),
    "planner_map": ("planner_map", "where each technique pays, on paper: the serving planner over models and budgets"),
    "warm_start": ("warm_start", "a fresh process's load + compile + first generate: cold vs loaded from cache_dir"),
    "serve": (
        "bench_serve",
        "served tokens/s on 64 mixed requests: the engine vs transformers' continuous batching vs lockstep generate",
    ),
    "gpu": ("gpu", "the GPU script: the CUDA tests and the scoreboard on one NVIDIA GPU (exit 2 without CUDA)"),
    "train": ("bench_train", "train step time and peak memory on 2 gloo ranks: tp 2 vs FSDP2 vs transformers' tp"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "usage: python -m benchmarks NAME [flags]   (python -m benchmarks NAME -h: its flags)\n\n" + "\n".join(rows)


OUTPUT_FLAGS = ("--json", "--markdown", "--out")  # the flags that name a file a benchmark writes when it ends


def missing_folder(argv: list[str]) -> str | None:
    """The first output file in ``argv`` (:data:`OUTPUT_FLAGS`, ``--flag FILE`` or ``--flag=FILE``) whose folder does
    not exist, as one line; None if every one has its folder. Checked before a benchmark measures anything, so a
    run of minutes is not lost to a path it could not write at the end."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in OUTPUT_FLAGS:
            continue
        if not eq:
            if i + 1 >= len(argv):
                continue  # the benchmark's own parser names the missing value
            value = argv[i + 1]
        folder = Path(value).resolve().parent
        if not folder.is_dir():
            return f"{flag} {value}: no directory {str(Path(value).parent)!r} to write it in; create it or name another"
    return None


def _terminated(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds like an error: local ranks are stopped, temporary files removed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, *rest = argv
    if name not in COMMANDS:
        print(f"python -m benchmarks: no benchmark named {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    missing = missing_folder(rest)
    if missing:
        print(f"python -m benchmarks {name}: {missing}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__package__}.{COMMANDS[name][0]}")
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return module.main(rest) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
