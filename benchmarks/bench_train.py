"""Train step time and peak memory on 2 gloo ranks: this library's train step against FSDP2 and transformers'
own tensor parallelism, on one seeded tiny Qwen3 and one global batch.

    python -m benchmarks train [--quick] [--repeat N] [--json FILE [--append]] [--systems a,b,...]

Every system runs the same step from the same weights (a Qwen3 transformers' ``save_pretrained`` wrote, float32):
transformers' causal-LM loss on one global batch of tokens, its backward, and AdamW after clipping the gradient
to a global norm of 1.0 (:mod:`benchmarks.train_systems`). Each system's first loss and gradient norm are
recorded; ``same_loss`` says the first losses agree within 1e-4, so the times compare the same computation.
The systems:

- ``fnpu_tp2_compiled`` / ``fnpu_tp2_eager``: this library, ``Plan(tp="tp")`` on ``{"tp": 2}``, one
  ``compile_train_step`` (inductor, forward + backward + update in one graph / ``backend="none"``);
- ``fsdp2`` / ``fsdp2_eager``: ``fully_shard`` on each decoder layer and the root, data parallel: each rank takes
  half the batch (the same global batch per step);
- ``hf_tp`` / ``hf_tp_eager``: ``from_pretrained(..., tp_plan="auto")`` (DTensor weights), the whole batch on both
  ranks. The compiled peers compile each decoder layer with ``torch.compile`` (before ``fully_shard``, as
  torchtitan does). A system that fails to build, compile or step is recorded with its error, not timed.

Measured:

- seconds per step: each system's first step and ``WARM`` more untimed; once all are built, one more untimed
  step each; then ``--repeat`` interleaved rounds, each step between barriers so the slowest rank counts;
- each peer's time over ours, round by round;
- the peak resident set (``ru_maxrss``) of each rank with one system alone in a fresh pair of processes: the
  whole process's peak (compiling included), and what it added over the same imports. torch has no CPU
  allocator statistics, so the bytes the training state holds (params, gradients, optimizer moments, local
  shards) are counted beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from functional_npu.runtime import LocalWorld

from .flags import count
from .peers import _between_barriers
from .timing import ratio, rounds, stats
from .train_systems import BUILDERS, COMPILED, HOW, HP, MAX_NORM

__all__ = ["SIZES", "HOW", "save_model", "train_rank", "measure", "summarize", "table", "main"]

WARM = 2  # untimed steps after the first (a compiled peer compiles again on its second step)
LOSS_TOL = 1e-4
# model (transformers' Qwen3Config fields) and global batch; head_dim 64, 4 query and 2 KV heads
SIZES = {
    "full": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=4096, batch=4, seq=64),
    "quick": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, vocab_size=1024, batch=4, seq=32),
}
OURS = ("fnpu_tp2_compiled", "fnpu_tp2_eager")


def save_model(path: str, size: str, seed: int = 0) -> None:
    """The seeded Qwen3 of ``SIZES[size]``, written by transformers' ``save_pretrained``."""
    import transformers as T

    fields = {k: v for k, v in SIZES[size].items() if k not in ("batch", "seq")}
    cfg = T.Qwen3Config(
        **fields, num_attention_heads=4, num_key_value_heads=2, head_dim=64 if size == "full" else 32,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    T.Qwen3ForCausalLM(cfg).save_pretrained(path)


def batch(size: str, seed: int = 1) -> torch.Tensor:
    """The global batch ``[B, S]`` of token ids (int64)."""
    s = SIZES[size]
    return torch.randint(0, s["vocab_size"], (s["batch"], s["seq"]), generator=torch.Generator().manual_seed(seed))


def _rss() -> int:
    """This process's peak resident set so far, in bytes (``ru_maxrss``: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the rank job ---------------------------------------------------------------------------------------------


def _imports() -> None:
    """What every system imports, done before the baseline so that no system is charged for another's."""
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import transformers  # noqa: F401
    import transformers.distributed  # noqa: F401

    import functional_npu.runtime.training.train_step  # noqa: F401


def _agreed(ok: bool) -> bool:
    """Whether every rank is ``ok`` (one verdict on every rank, so none waits in a collective alone)."""
    flag = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def _build(ctx: Any, name: str, path: str, tokens: torch.Tensor) -> tuple[dict[str, Any], Callable[[], Any] | None]:
    """Build ``name`` on this rank, take its first step and ``WARM`` more: ``(result, its step or None)``."""
    out: dict[str, Any] = {"rss_before": _rss()}
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    system = None
    try:  # each layer compiled by both peers adds to the recompile count of one frame: raised for this build only
        with torch._dynamo.config.patch(recompile_limit=64):
            t0 = time.perf_counter()
            system = BUILDERS[name](ctx, path, tokens)
            out["first_loss"], out["first_grad_norm"] = system.run()
            out["first_step_s"] = time.perf_counter() - t0  # load + build + compile + the first step
            for _ in range(WARM):
                system.run()
        out["state_bytes"], out["notes"] = system.held(), system.notes
        if name in COMPILED and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs:
            raise RuntimeError(f"{name} traced no graph: it ran eagerly")
    except Exception as e:  # noqa: BLE001 - any failure is the system's result, and the others still run
        out["error"], system = f"{type(e).__name__}: {e}"[:2000], None
    if not _agreed(system is not None):
        out.setdefault("error", "another rank failed to build or step it")
        system = None
    out["rss_peak"] = _rss()
    return out, system.run if system else None


def train_rank(ctx: Any, path: str, tokens: torch.Tensor, names: list[str], repeat: int) -> dict[str, Any]:
    """Rank job: build every system in ``names`` in turn (first step + ``WARM``), then time the ones that ran in
    ``repeat`` interleaved rounds between barriers, after one untimed step each once all are built (``settle_s``).
    ``{name: {first_loss, first_grad_norm, first_step_s, state_bytes, rss_before, rss_peak, notes, settle_s, times,
    last_loss, recompiled_in_rounds} or {error, ...}}``, plus ``"rss_imported"``."""
    _imports()
    result: dict[str, Any] = {"rss_imported": _rss()}
    runs = {}
    for name in names:
        result[name], run = _build(ctx, name, path, tokens)
        if run is not None:
            runs[name] = run
    for name, run in runs.items():  # once more, each in the state all the others left: a later build registering
        # pytree nodes (transformers' outputs) fails a guard of an earlier compiled step, which compiles again
        result[name]["settle_s"] = _between_barriers(run)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    times = rounds({n: functools.partial(_between_barriers, fn) for n, fn in runs.items()}, repeat) if repeat else {}
    recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs
    for name, run in runs.items():
        result[name] |= {"times": times.get(name, []), "last_loss": run()[0], "recompiled_in_rounds": recompiled}
    return result


# ---- the run --------------------------------------------------------------------------------------------------


def measure(size: str, repeat: int, names: list[str] | None = None, *, timeout: float = 3600) -> dict[str, Any]:
    """One run: each system alone in a fresh pair of ranks (its peak memory), then all of them in one pair, timed in
    ``repeat`` interleaved rounds; :func:`summarize`'d."""
    names = list(names or BUILDERS)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(tmp, size)
        tokens = batch(size)
        alone = {}
        for name in names:
            with LocalWorld(2, timeout=timeout, remove_when_orphaned=(tmp,)) as world:
                alone[name] = world.run(train_rank, tmp, tokens, [name], 0)
            print(f"  {name}: built alone", flush=True)
        with LocalWorld(2, timeout=timeout, remove_when_orphaned=(tmp,)) as world:
            together = world.run(train_rank, tmp, tokens, names, repeat)
    return summarize(together, alone, size=size, repeat=repeat)


def summarize(together: list[dict], alone: dict[str, list[dict]] | None, *, size: str, repeat: int) -> dict[str, Any]:
    """The run's JSON from the ranks' results. Per system: ``step_s`` (the slowest rank per round), ``vs`` (its time
    over each of ours, round by round: median, min, max), its first loss and gradient norm, ``memory`` (from
    ``alone``: each system in its own processes), or its ``error``. ``machine.load_avg`` is taken at the end."""
    systems: dict[str, Any] = {}
    for name in (n for n in together[0] if n != "rss_imported"):
        first = together[0][name]
        if "error" in first:
            systems[name] = {"how": HOW[name], "ran": False, "error": _error(together, name)}
            continue
        steps = [max(r[name]["times"][i] for r in together) for i in range(len(first["times"]))]
        keep = ("first_loss", "first_grad_norm", "first_step_s", "settle_s", "last_loss", "state_bytes", "notes")
        systems[name] = {"how": HOW[name], "ran": True, "step_s": stats(steps)} | {k: first[k] for k in keep}
        systems[name]["recompiled_in_rounds"] = first["recompiled_in_rounds"]
        if alone and name in alone:
            systems[name]["memory"] = _memory(alone[name], name)
    ran = {n: s for n, s in systems.items() if s["ran"]}
    for name, s in ran.items():
        s["vs"] = {o: ratio(s["step_s"]["runs"], ran[o]["step_s"]["runs"]) for o in OURS if o in ran and o != name}
    losses, norms = [s["first_loss"] for s in ran.values()], [s["first_grad_norm"] for s in ran.values()]
    return {
        "size": size,
        "model": {k: v for k, v in SIZES[size].items() if k not in ("batch", "seq")},
        "global_batch": [SIZES[size]["batch"], SIZES[size]["seq"]],
        "repeat": repeat,
        "hyperparameters": HP | {"max_grad_norm": MAX_NORM},
        "systems": systems,
        "same_loss": len(losses) > 1 and max(losses) - min(losses) <= LOSS_TOL,
        "loss_spread": max(losses) - min(losses) if losses else None,
        "grad_norm_spread": max(norms) - min(norms) if norms else None,
        "machine": _machine(),
    }


def _error(ranks: list[dict], name: str) -> str:
    """The first rank's own error (not the echo of another rank's)."""
    errors = [r[name]["error"] for r in ranks]
    return next((e for e in errors if not e.startswith("another rank")), errors[0])


def _memory(ranks: list[dict], name: str) -> dict[str, Any]:
    """Peak RSS per rank with the system alone in its processes, and what it added over the same imports."""
    return {
        "peak_rss_bytes": [r[name]["rss_peak"] for r in ranks],
        "added_rss_bytes": [r[name]["rss_peak"] - r["rss_imported"] for r in ranks],
        "state_bytes": [r[name].get("state_bytes") for r in ranks],
        "first_loss": ranks[0][name].get("first_loss"),
        "error": ranks[0][name].get("error"),
    }


def _machine() -> dict[str, Any]:
    import transformers

    return {
        "cpus": os.cpu_count(),
        "threads_per_rank": max(1, (os.cpu_count() or 1) // 2),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "load_avg": os.getloadavg(),
    }


def _cell(s: dict[str, Any], fmt: Callable[[float], str]) -> str:
    return f"{fmt(s['median'])} ({fmt(s['min'])}-{fmt(s['max'])})"


def table(runs: list[dict[str, Any]]) -> str:
    """Every system's row, figures of each run separated by ``/``: step ms, each peer's time over ours (median and
    spread of the per-round ratios), peak and added RSS of rank 0 (MiB), state bytes, first loss."""
    rows = [
        "| system | ms / step, median (min-max) | time / fnpu compiled | time / fnpu eager | peak RSS rank 0 "
        "(added) MiB | state MiB | first loss |",
        "|---|---|---|---|---|---|---|",
    ]
    ms, x = (lambda v: f"{v * 1e3:.0f}"), (lambda v: f"{v:.2f}x")
    mib = lambda v: f"{v / 2**20:.0f}"  # noqa: E731
    for name in runs[-1]["systems"]:
        cells = [[] for _ in range(6)]
        for run in runs:
            s = run["systems"].get(name, {"ran": False, "error": "not run"})
            if not s["ran"]:
                cells[0].append(f"did not run: {s['error'][:120]}")
                continue
            vs, mem = s["vs"], s.get("memory")
            cells[0].append(_cell(s["step_s"], ms))
            cells[1].append(_cell(vs[OURS[0]], x) if OURS[0] in vs else "-")
            cells[2].append(_cell(vs[OURS[1]], x) if OURS[1] in vs else "-")
            cells[3].append(f"{mib(mem['peak_rss_bytes'][0])} ({mib(mem['added_rss_bytes'][0])})" if mem else "-")
            cells[4].append(f"{s['state_bytes'] / 2**20:.1f}")
            cells[5].append(f"{s['first_loss']:.6f}")
        rows.append(f"| {name} | " + " | ".join(" / ".join(c) for c in cells if c) + " |")
    return "\n".join(rows)


def report(out: dict[str, Any]) -> str:
    """The table, how each system ran, and the checks of the last run."""
    last = out["runs"][-1]
    lines = [table(out["runs"]), ""]
    for name, s in last["systems"].items():
        extra = "; ".join(s.get("notes", {}).values()) if s["ran"] else f"did not run: {s['error']}"
        lines.append(f"- {name}: {s['how']}" + (f"; {extra}" if extra else ""))
    same = "equal" if last["same_loss"] else "DIFFER"
    lines.append(
        f"first-step losses {same} within {LOSS_TOL} (spread {last['loss_spread']:.2e}); gradient norms before "
        f"clipping spread {last['grad_norm_spread']:.2e}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks train", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, 2 rounds")
    parser.add_argument("--repeat", type=count, default=None, help="interleaved rounds (default 5, --quick 2)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--append", action="store_true", help="add this run to the runs in --json FILE")
    parser.add_argument("--systems", default=",".join(BUILDERS), help=f"comma-separated, of {', '.join(BUILDERS)}")
    args = parser.parse_args(argv)
    names = [n for n in args.systems.split(",") if n]
    unknown = [n for n in names if n not in BUILDERS]
    if unknown or not names:
        parser.error(f"--systems: no system named {unknown[0] if unknown else ''!r}; choose from {', '.join(BUILDERS)}")
    repeat = args.repeat if args.repeat is not None else (2 if args.quick else 5)
    if repeat < 1:
        parser.error(f"--repeat must be >= 1, got {repeat}")
    if args.append and not args.json:
        parser.error("--append adds to the runs in --json FILE; pass --json")
    size = "quick" if args.quick else "full"
    s = SIZES[size]
    print(f"train: Qwen3 {s['num_hidden_layers']} layers, hidden {s['hidden_size']}, vocab {s['vocab_size']}, "
          f"global batch {s['batch']} x {s['seq']}, 2 gloo ranks, {repeat} rounds", flush=True)  # fmt: skip
    run = measure(size, repeat, names)
    earlier = _runs(args.json) if args.append else []
    out = {"runs": [*earlier, run]}
    print(report(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def _runs(path: str) -> list[dict[str, Any]]:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return list(json.loads(Path(path).read_text())["runs"])
    return []
