"""Warm start: ``python -m benchmarks warm_start [--quick] [--repeat N] [--json FILE]``.

Two fresh processes on one ``compile_model(..., cache_dir=DIR)``: the cold one finds ``DIR`` empty, compiles
and saves its graphs there; the warm one loads them. Each process gets its own empty inductor cache
(``TORCHINDUCTOR_CACHE_DIR``, a fresh temporary directory), so the only state the warm process shares with
the cold one is ``DIR``. Each times load + compile + first generate (after its imports, as the scoreboard's
compile probe does), and its whole life as its parent sees it (interpreter start, imports, exit). The pair
runs ``repeat`` times, each on a fresh ``DIR``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from functional_npu.core import Mesh
from functional_npu.models.llama import init_params
from functional_npu.runtime.loading import load_checkpoint, save_checkpoint
from functional_npu.runtime.serving import cache_length, compile_model

from . import child_env
from .configs import FULL, QUICK
from .flags import count

METHOD = (
    "compile_model(cache_dir=...): dynamo precompile (torch.compile(fn).aot_compile) per graph, saved with its "
    "inductor kernels; loaded with torch.compiler.load_compiled_function (no dynamo tracing, no inductor, no C++ "
    "compiler); every process on a fresh empty TORCHINDUCTOR_CACHE_DIR"
)


def first_generate(path: str, cache_dir: str, prompt_len: int, new: int) -> dict[str, Any]:
    """In a fresh process: load, compile with ``cache_dir`` and generate ``new`` tokens once; the seconds it took,
    the tokens, which graphs were loaded and which compiled, and torch's compile counters."""
    mesh = Mesh.abstract({"tp": 1}, 0)
    prompt = list(range(1, prompt_len + 1))
    t0 = time.perf_counter()
    model = compile_model(
        load_checkpoint(path, mesh),
        mesh,
        batch_sizes=[1],
        max_seq_len=cache_length(prompt_len + new),
        cache_dir=cache_dir,
    )
    tokens = model.generate([prompt], new)
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate([prompt], new)  # the same again: what the generate itself takes, nothing left to compile or load
    steady = time.perf_counter() - t0
    counters = torch._dynamo.utils.counters
    return {
        "seconds": seconds,
        "steady_generate_s": steady,
        "tokens": tokens,
        "loaded": model.forward.loaded,
        "compiled": model.forward.compiled_now,
        "dynamo_graphs": counters["stats"]["unique_graphs"],  # frames dynamo traced
        "aot_autograd": counters["aot_autograd"]["total"],  # graphs the backend compiled
    }


def _child(path: str, cache_dir: str, prompt_len: int, new: int, timeout: float) -> dict[str, Any]:
    """:func:`first_generate` in a fresh ``python`` with its own empty inductor cache; its result plus ``wall_s``."""
    with tempfile.TemporaryDirectory(prefix="inductor-") as inductor:
        code = (
            "import json; from benchmarks.warm_start import first_generate; "
            f"print(json.dumps(first_generate({path!r}, {cache_dir!r}, {prompt_len}, {new})))"
        )
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=child_env(TORCHINDUCTOR_CACHE_DIR=inductor),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"warm_start: the child process failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"wall_s": wall}


def warm_start(path: str, prompt_len: int, new: int, repeat: int = 2, timeout: float = 1200.0) -> dict[str, Any]:
    """Cold then warm fresh processes on the checkpoint at ``path``, ``repeat`` pairs (each on a fresh cache_dir).

    Returns ``{"cold_s": [...], "warm_s": [...], "ratio": [...], "same_tokens": bool, "method": str}`` (load +
    compile + first generate, after imports), the same of the processes' whole lives as ``cold_wall_s`` /
    ``warm_wall_s`` / ``wall_ratio``, ``warm_steady_generate_s`` (the warm process's second generate: the part of
    its first that is generating, not starting; on a busy machine it grows most), and ``warm_loaded_everything``:
    whether every warm process loaded all its graphs and compiled none (dynamo traced no frame, the backend
    compiled no graph)."""
    runs = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="fnpu-cache-") as cache:
            runs.append([_child(path, cache, prompt_len, new, timeout) for _ in ("cold", "warm")])
    cold, warm = [r[0] for r in runs], [r[1] for r in runs]
    return {
        "cold_s": [r["seconds"] for r in cold],
        "warm_s": [r["seconds"] for r in warm],
        "ratio": [w["seconds"] / c["seconds"] for c, w in zip(cold, warm)],
        "cold_wall_s": [r["wall_s"] for r in cold],
        "warm_wall_s": [r["wall_s"] for r in warm],
        "wall_ratio": [w["wall_s"] / c["wall_s"] for c, w in zip(cold, warm)],
        "warm_steady_generate_s": [r["steady_generate_s"] for r in warm],
        "same_tokens": all(r["tokens"] == cold[0]["tokens"] for r in cold + warm),
        "warm_loaded_everything": all(
            r["loaded"] and not r["compiled"] and not r["dynamo_graphs"] and not r["aot_autograd"] for r in warm
        ),
        "graphs": cold[0]["compiled"],
        "method": METHOD,
    }


def report(out: dict[str, Any]) -> str:
    """The results as a markdown table and a line on the tokens."""
    rows = [
        "| pair | cold s | warm s | warm / cold | of which generating | cold wall s | warm wall s | wall warm / cold |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = ("cold_s", "warm_s", "ratio", "warm_steady_generate_s", "cold_wall_s", "warm_wall_s", "wall_ratio")
    for i, (c, w, r, g, cw, ww, wr) in enumerate(zip(*(out[k] for k in keys))):
        rows.append(f"| {i + 1} | {c:.1f} | {w:.2f} | {r:.1%} | {g:.2f} | {cw:.1f} | {ww:.2f} | {wr:.1%} |")
    rows.append(
        f"\ngraphs: {', '.join(out['graphs'])}; same tokens cold and warm: {out['same_tokens']}; every warm process "
        f"loaded all its graphs and compiled none: {out['warm_loaded_everything']}"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks warm_start [flags]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks warm_start", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4-layer model and 16 + 16 tokens")
    parser.add_argument("--repeat", type=count, default=2, help="cold/warm pairs, each on a fresh cache_dir; default 2")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    cfg, (prompt_len, new) = (QUICK, (16, 16)) if args.quick else (FULL, (32, 32))
    print(
        f"warm_start: {cfg.architecture}-style, {cfg.num_layers} layers, fp32, batch 1, prompt {prompt_len}, "
        f"{new} new tokens, {torch.get_num_threads()} threads; {args.repeat} cold/warm pairs of fresh processes",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="fnpu-ckpt-") as path:
        save_checkpoint(init_params(cfg, seed=0), path)
        out = warm_start(path, prompt_len, new, repeat=args.repeat)
    print(report(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0
