"""The scoreboard: ``python -m benchmarks bench [--quick] [--repeat N] [--json FILE [--append]] [--plots DIR]``.

One run measures, on one seeded 70.5M-parameter Qwen3-style model written four ways (fp32, bf16, int8, int4):

- decode tokens/s at batch 1, 8 and 32 of this library in its **default configuration** (``compile_model`` with no
  mode flag: what the device measures fastest) against the peers a user would pick: transformers' ``generate``
  compiled with a static cache at the same dtype (with each of inductor's wrappers; the faster counts in each
  round), torchao's weight-only int8 / int4 compiled (when it runs here), all in interleaved rounds
  (:mod:`benchmarks.formats`);
- the **roofline of memory and compute**: a plain streaming read's bandwidth
  (:func:`benchmarks.timing.read_bandwidth`) and the fp32 and bf16 matmul peaks
  (:func:`benchmarks.formats.gemm_peak`), sampled before the first and after every round; each cell's floor is
  ``max(bytes / read, FLOPs / peak)`` for one step (:mod:`benchmarks.roofline`), and the term that binds is named;
- the **warm start**: load + compile + first generate in a fresh process, cold and then warm from
  ``compile_model(cache_dir=...)`` (:mod:`benchmarks.warm_start`).

Every share and ratio is taken round by round, within the run. ``--append`` adds the run to the runs already in
``--json FILE`` (a second, separate run of the command confirms the first); the targets table marks a target met
only when every run meets it. ``--peers-only`` runs the distributed peers on 2 gloo ranks instead
(:mod:`benchmarks.peers`, its own JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from functional_npu.core import flatten_with_paths
from functional_npu.models.llama import LlamaConfig, abstract_params, init_params
from functional_npu.runtime import LocalWorld
from functional_npu.runtime.loading import save_checkpoint

from .configs import FULL, QUICK, REAL
from .flags import count
from .formats import FORMATS, WRAPPERS, format_table, formats_plot, run_formats, targets, targets_table
from .peers import decode_tp_peer, peers_report, reshard_peer
from .roofline import weight_count
from .timing import pin_threads

__all__ = ["decode_bytes_per_token", "run_bench", "main", "merged", "cold_compiles"]


def decode_bytes_per_token(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> int:
    """Weight bytes one decode step reads: every weight except the embedding table, of which one row."""
    return (weight_count(cfg) + cfg.hidden_size) * dtype.itemsize


def run_bench(
    *,
    quick: bool = False,
    json_path: str | None = None,
    append: bool = False,
    repeat: int = 5,
    plot_dir: str | None = None,
    warm_start: bool = True,
    model: str | None = None,
    formats: tuple[str, ...] = tuple(FORMATS),
) -> dict[str, Any]:
    """One run of the scoreboard (module docstring): prints the decode table, the warm start and the targets
    against every run in the JSON (this one, and the earlier ones with ``append``); returns the whole JSON.
    ``model``: a model of released shapes (:data:`benchmarks.configs.REAL`) in place of the benchmarks' own; its runs
    go under ``sizes[model]`` in the JSON, beside the default model's."""
    cores = pin_threads(None)
    cfg = REAL[model] if model else QUICK if quick else FULL
    new = 16 if quick else 32
    n_params = sum(x.numel() for _, x in flatten_with_paths(abstract_params(cfg)))
    print(
        f"bench: {model or cfg.architecture + '-style'}, {n_params / 1e6:.1f}M params, prompt 32, {new} new tokens, "
        f"{torch.get_num_threads()} threads, {repeat} interleaved rounds, formats {', '.join(formats)}",
        flush=True,
    )
    run: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, cold_compiles(Path(tmp) / "inductor"):
        # a released model's size: transformers with its default (Python) wrapper only, one cold compile each
        wrappers = ("py",) if model else tuple(WRAPPERS)
        run["decode"] = run_formats(cfg, Path(tmp), new=new, repeat=repeat, formats=formats, wrappers=wrappers)
        if warm_start:
            from .warm_start import warm_start as measure_warm_start

            save_checkpoint(init_params(cfg, seed=0), Path(tmp) / "warm")
            run["warm_start"] = measure_warm_start(str(Path(tmp) / "warm"), 32, new)
    run["model"] = {"name": model or "bench", "architecture": cfg.architecture, "params": n_params,
                    "layers": cfg.num_layers, "config": cfg.to_hf()}  # fmt: skip
    run["machine"] = _machine(cores)
    whole = merged(_whole(json_path) if json_path else {}, run, model, append)
    _write(whole, json_path, plot_dir if not model else None)  # first: a report that fails loses no run
    _report(whole["sizes"][model] if model else whole)
    return whole


def merged(whole: dict[str, Any], run: dict[str, Any], model: str | None, append: bool) -> dict[str, Any]:
    """The results JSON ``whole`` with ``run`` added: the benchmarks' own model's runs at the top (``runs``,
    ``targets``), a released model's under ``sizes[model]``; ``append`` keeps that section's earlier runs, else
    ``run`` replaces them. Every other section is kept as it was."""
    out = dict(whole) | {"sizes": dict(whole.get("sizes", {}))}
    section = dict(out["sizes"].get(model, {})) if model else out
    runs = (list(section.get("runs", [])) if append else []) + [run]
    section |= {"runs": runs, "targets": targets([r["decode"] for r in runs])}
    if model:
        out["sizes"][model] = section
    return out


@contextlib.contextmanager
def cold_compiles(where: Path) -> Iterator[None]:
    """Inductor's caches in ``where`` (new, and removed with the run) for the block: every compile is cold, so the
    compile times are what a new user waits, and no cache outlives the run."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(where)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def _whole(json_path: str) -> dict[str, Any]:
    """The JSON already at ``json_path``, or an empty one when it is missing or not this benchmark's."""
    try:
        got = json.loads(Path(json_path).read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def run_peers(*, quick: bool, json_path: str | None, repeat: int) -> dict[str, Any]:
    """The distributed peers on 2 gloo ranks of one thread each: decode at tp 2, then reshard."""
    cores = pin_threads(None)
    cfg = QUICK if quick else FULL
    new = 16 if quick else 32
    prompt = [(7 * i) % cfg.vocab_size for i in range(1, 33)]
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(init_params(cfg, seed=0), tmp)
        with LocalWorld(2, threads=max(1, (os.cpu_count() or 2) // 2)) as world:
            tp2 = world.run(decode_tp_peer, tmp, prompt, new, repeat)[0]
            print("  decode at tp 2 done", flush=True)
            peers = {"decode_tp": tp2["peer"], "reshard": world.run(reshard_peer, cfg, repeat)[0]}
    out = {"peers": peers, "fnpu_compiled_tp2": tp2["fnpu"], "machine": _machine(cores)}
    print("\npeers on 2 gloo ranks (one thread each):")
    print(peers_report(peers))
    _write(out, json_path, None)
    return out


def _machine(cores: list[int]) -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "cores_pinned": cores,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_name(),
    }


def _cpu_name() -> str:
    try:
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor()


def _report(out: dict[str, Any]) -> None:
    """Print the decode table (every run, medians and spreads), the warm starts and the targets."""
    runs = out["runs"]
    reads = " / ".join(f"{r['decode']['read_gb_s']['median']:.1f}" for r in runs)
    gemm = " / ".join(
        f"{r['decode']['gemm_gflop_s']['fp32']['median']:.0f} and {r['decode']['gemm_gflop_s']['bf16']['median']:.0f}"
        for r in runs
    )
    print(f"\ndecode ({len(runs)} run(s), figures per run separated by /):")
    print(format_table([r["decode"] for r in runs]))
    print(f"\nthe roofline: read bandwidth {reads} GB/s; matmul peak (fp32 and bf16) {gemm} GFLOP/s")
    for i, r in enumerate(runs, 1):
        if "warm_start" in r:
            w = r["warm_start"]
            pairs = ", ".join(f"{c:.1f} s -> {h:.1f} s ({h / c:.0%})" for c, h in zip(w["cold_s"], w["warm_s"]))
            print(f"warm start, run {i} (fresh processes, cold -> warm): {pairs}")
    print("\ntargets:")
    print(targets_table(out["targets"]))


def _write(out: dict[str, Any], json_path: str | None, plot_dir: str | None) -> None:
    """The PNG plot of the last run under ``plot_dir`` and the JSON at ``json_path``, each if given."""
    if plot_dir and "runs" in out:
        Path(plot_dir).mkdir(parents=True, exist_ok=True)
        made = formats_plot(out["runs"][-1]["decode"], str(Path(plot_dir) / "scoreboard.png"))
        print(f"plot: {plot_dir}/scoreboard.png" if made else "plot: skipped (pip install matplotlib)")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks bench [flags]``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks bench",
        description="the scoreboard: decode by weight format against the read roofline and the peers, and the "
        "warm start (needs transformers)",
    )
    parser.add_argument("--quick", action="store_true", help="a 4-layer model and fewer tokens")
    parser.add_argument("--repeat", type=count, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument(
        "--append", action="store_true", help="add this run to the runs in --json FILE (a second run confirms)"
    )
    parser.add_argument("--no-warm-start", action="store_true", help="skip the fresh-process warm-start probe")
    parser.add_argument("--plots", metavar="DIR", default=None, help="write scoreboard.png here (needs matplotlib)")
    parser.add_argument(
        "--model", choices=list(REAL), default=None, help="a model of released shapes (random weights) in place of the "
        "70.5M one; its runs go under sizes.MODEL in the JSON",
    )  # fmt: skip
    parser.add_argument("--formats", default=",".join(FORMATS), help="formats to run (default fp32,bf16,int8,int4)")
    parser.add_argument(
        "--peers-only",
        action="store_true",
        help="only the distributed peers on 2 gloo ranks: decode at tp 2 and reshard vs DTensor.redistribute",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.append and not args.json:
        parser.error("--append adds to the runs in --json FILE; pass --json")
    formats = tuple(f for f in args.formats.split(",") if f)
    wrong = [f for f in formats if f not in FORMATS]
    if wrong or not formats:
        parser.error(f"--formats takes a comma-separated list of {', '.join(FORMATS)}, got {args.formats!r}")
    if args.model and args.quick:
        parser.error("--quick shrinks the benchmarks' own model; --model runs a released model's shapes: pick one")
    try:
        import transformers  # noqa: F401
    except ImportError:
        parser.error("bench compares against transformers: pip install -e '.[bench]'")
    if args.peers_only:
        run_peers(quick=args.quick, json_path=args.json, repeat=args.repeat)
        return 0
    run_bench(
        quick=args.quick,
        json_path=args.json,
        append=args.append,
        repeat=args.repeat,
        plot_dir=args.plots,
        warm_start=not args.no_warm_start,
        model=args.model,
        formats=formats,
    )
    return 0
