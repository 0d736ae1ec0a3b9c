"""The scoreboard: ``python -m benchmarks bench [--quick] [--json FILE] [--plots DIR] [--formats-only | --peers-only]``.

On the same weights in the same run: decode and prefill tokens/s of this library (eager, compiled,
compiled tp=2 on two gloo ranks) and of transformers (eager ``generate``; ``generate`` compiled
with a static cache), the decode roofline (same-run matrix-vector bandwidth / weight bytes read per
token) and each system's share of it, and cold vs warm compile time (fresh processes sharing an
inductor cache dir). Decode tokens/s are ``(N - 1) / (T(N new tokens) - T(1 new token))``, the
same formula for every system, so prefill is excluded from decode and vice versa.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from functional_npu.core.mesh import Mesh
from functional_npu.core.tree import flatten_with_paths
from functional_npu.models.llama import LlamaConfig, abstract_params, init_params
from functional_npu.runtime.checkpoint import load_checkpoint
from functional_npu.runtime.compile import greedy_generate
from functional_npu.runtime.launch import LocalWorld, RankContext
from functional_npu.runtime.save import save_checkpoint

from . import child_env
from .configs import FULL, QUICK
from .emulated_link import model_check, run_link_bench
from .formats import fnpu_runner, format_table, formats_plot, pyplot, run_formats, transformers_runner
from .peers import decode_tp_peer, peers_report, reshard_peer
from .prefetch_runs import prefetch_plot, prefetch_table
from .timing import interleaved, matvec_bandwidth, pin_threads, stats


def decode_bytes_per_token(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> int:
    """Weight bytes one decode step reads: every weight except the embedding table, of which one row."""
    size = torch.tensor([], dtype=dtype).element_size()
    total = sum(x.numel() for p, x in flatten_with_paths(abstract_params(cfg)) if p != "embed")
    return (total + cfg.hidden_size) * size


def _fnpu_compiled(ctx: RankContext, path: str, prompt: list[int], new: int) -> tuple[Callable[[int, int], Any], float]:
    run, _ = fnpu_runner(path, ctx.mesh({"tp": ctx.world_size}), prompt, new)
    t0 = time.perf_counter()
    run(1, new)
    run(1, 1)
    return run, time.perf_counter() - t0


def _hf(path: str, prompt: list[int], new: int, compiled: bool) -> tuple[Callable[[int, int], Any], float]:
    run = transformers_runner(path, prompt, torch.float32, compile_config={} if compiled else None)
    t0 = time.perf_counter()
    run(1, new)
    return run, time.perf_counter() - t0


def compile_once(path: str, prompt_len: int, new: int) -> float:
    """Seconds to load, compile and generate once (a child process: the cold/warm compile probe)."""
    mesh = Mesh.abstract({"tp": 1}, 0)
    t0 = time.perf_counter()
    run, _ = fnpu_runner(path, mesh, list(range(1, prompt_len + 1)), new)
    run(1, new)
    return time.perf_counter() - t0


def _compile_cold_warm(path: str, prompt_len: int, new: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        env = child_env(
            TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1"
        )
        code = f"from benchmarks.scoreboard import compile_once; print(compile_once({path!r}, {prompt_len}, {new}))"
        times = [
            float(
                subprocess.run(
                    [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
                ).stdout.split()[-1]
            )
            for _ in range(2)
        ]
    return {"cold": times[0], "warm": times[1]}


def scoreboard_plot(out: dict[str, Any], path: str) -> bool:
    """Decode tokens/s of every system against the roofline (PNG); False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    names = list(out["decode_tok_s"])
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.barh(
        names,
        [out["decode_tok_s"][n] for n in names],
        color=["tab:blue" if n.startswith("fnpu") else "tab:gray" for n in names],
    )
    ax.axvline(
        out["roofline_decode_tok_s"],
        color="tab:red",
        ls="--",
        label=f"roofline {out['roofline_decode_tok_s']:.0f} tok/s",
    )
    ax.set(
        xlabel="decode tokens/s (batch 1)",
        title=(
            f"{out['model']['params'] / 1e6:.0f}M-param {out['model']['architecture']}, fp32, "
            f"{out['machine']['threads']} threads"
        ),
    )
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_bench(
    *,
    quick: bool = False,
    json_path: str | None = None,
    repeat: int = 3,
    plot_dir: str | None = None,
    formats_only: bool = False,
    peers_only: bool = False,
) -> dict[str, Any]:
    """Run every system, print a markdown table, optionally write JSON and PNG plots; returns the results.

    The process is pinned to its cores with as many torch threads; every figure is the median of ``repeat``
    interleaved rounds, with its spread in the JSON. ``formats_only``: only the weight formats
    (:mod:`benchmarks.formats`, JSON key ``formats``); ``peers_only``: only the distributed peers
    (:mod:`benchmarks.peers`, JSON key ``peers``)."""
    cores = pin_threads(None)
    cfg = QUICK if quick else FULL
    if formats_only:
        out = {"formats": _formats(cfg, 16 if quick else 32, repeat), "machine": _machine(cores)}
        _write(out, json_path, plot_dir)
        return out
    prompt_len, new = (16, 16) if quick else (32, 32)
    prompt = [(7 * i) % cfg.vocab_size for i in range(1, prompt_len + 1)]
    if peers_only:
        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(init_params(cfg, seed=0), tmp)
            tp2, peers = _tp2_and_peers(cfg, tmp, prompt, new, repeat)
        out = {"peers": peers, "fnpu_compiled_tp2": tp2, "machine": _machine(cores)}
        print("\npeers on 2 gloo ranks (one thread each):")
        print(peers_report(peers))
        _write(out, json_path, None)
        return out
    n_params = sum(x.numel() for _, x in flatten_with_paths(abstract_params(cfg)))
    print(
        f"bench: {cfg.architecture}-style, {n_params / 1e6:.1f}M params, fp32, batch 1, "
        f"prompt {prompt_len}, {new} new tokens, {torch.get_num_threads()} threads"
    )
    res, compile_s, prefetch, bandwidth, peers = _measure(cfg, prompt, new, repeat, quick)
    out = _summary(cfg, res, compile_s, bandwidth, n_params, prompt_len, new)
    out["peers"] = peers
    out["prefetch"] = prefetch["loopback"]
    out["emulated_link"] = {k: prefetch[k] for k in ("emulated", "rate_bits", "skipped")}
    # the cost model's predicted exposure against this run's measurements, on both links
    out["emulated_link"]["model_check"] = {
        link: model_check(prefetch[link]) for link in ("loopback", "emulated") if prefetch[link] is not None
    }
    out["machine"] = _machine(cores)
    _report(cfg, out, prefetch)
    out["formats"] = _formats(cfg, new, repeat)
    _write(out, json_path, plot_dir)
    return out


def _formats(cfg: LlamaConfig, new: int, repeat: int) -> dict[str, Any]:
    print(f"\nweight formats ({cfg.num_layers} layers, every linear layer quantized, lm_head included):", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        res = run_formats(cfg, Path(tmp), new=new, repeat=repeat)
    print(format_table(res))
    return res


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


def _measure(
    cfg: LlamaConfig, prompt: list[int], new: int, repeat: int, quick: bool
) -> tuple[dict[str, dict[str, float]], dict[str, float], Any, list[float], dict[str, Any]]:
    """On one saved checkpoint: every system's rates, the cold and warm compile times, the layer-sharded
    prefetch runs, and the matrix-vector bandwidth sampled before, between and after the rates (one sample
    can land on a busy moment of a shared machine; the roofline takes their median)."""
    res: dict[str, dict[str, Any]] = {}
    bandwidth = [matvec_bandwidth()]
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(init_params(cfg, seed=0), tmp)
        mesh = Mesh.abstract({"tp": 1}, 0)
        params = load_checkpoint(tmp, mesh)
        systems: dict[str, Callable[[int, int], Any]] = {
            "fnpu_eager": lambda b, n: greedy_generate(params, [prompt] * b, n, mesh)
        }
        first: dict[str, float] = {}
        systems["fnpu_compiled"], first["fnpu_compiled"] = _fnpu_compiled(RankContext(0, 1), tmp, prompt, new)
        systems["hf_eager"], first["hf_eager"] = _hf(tmp, prompt, new, compiled=False)
        systems["hf_compiled"], first["hf_compiled"] = _hf(tmp, prompt, new, compiled=True)
        print("  every system built; interleaved rounds ...", flush=True)
        runs = interleaved(systems, (1,), new, len(prompt), repeat)
        for name, per in runs.items():
            res[name] = {"decode": per[1]["decode"], "prefill": per[1]["prefill"]}
            if name in first:
                res[name]["compile_s"] = first[name]
        print("  in-process systems done", flush=True)
        bandwidth.append(matvec_bandwidth())
        res["fnpu_compiled_tp2"], peers = _tp2_and_peers(cfg, tmp, prompt, new, repeat)
        bandwidth.append(matvec_bandwidth())
        compile_s = _compile_cold_warm(tmp, len(prompt), new)
        # batch 64: a layer computes long enough that an emulated link can match it (see the README)
        ks = (0, 1, 2) if quick else (0, 1, 2, 3)
        prefetch = run_link_bench(tmp, ks=ks, batch=64, steps=4 if quick else 8, repeat=3 if quick else 5)
        print("  layer-sharded prefetch done (loopback" + ("" if prefetch["skipped"] else ", emulated link") + ")")
    return res, compile_s, prefetch, bandwidth, peers


def _tp2_and_peers(
    cfg: LlamaConfig, path: str, prompt: list[int], new: int, repeat: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """On 2 gloo ranks of one thread each: this library compiled at tp 2 (its rates and first-call time) with
    transformers' tp plan in the same rounds, then reshard against DTensor.redistribute."""
    with LocalWorld(2, threads=max(1, (os.cpu_count() or 2) // 2)) as world:
        tp2 = world.run(decode_tp_peer, path, prompt, new, repeat)[0]
        print("  fnpu compiled tp=2 and transformers' tp plan done", flush=True)
        peers = {"decode_tp": tp2["peer"], "reshard": world.run(reshard_peer, cfg, repeat)[0]}
    print("  reshard against DTensor.redistribute done", flush=True)
    return tp2["fnpu"], peers


def _summary(
    cfg: LlamaConfig,
    res: dict[str, dict[str, float]],
    compile_s: dict[str, float],
    bandwidth: list[float],
    n_params: int,
    prompt_len: int,
    new: int,
) -> dict[str, Any]:
    """The results as one JSON-ready dict: tokens/s per system, the roofline from the median of the matvec
    bandwidth samples, the run's setup."""
    bw = statistics.median(bandwidth)
    return {
        "decode_tok_s": {k: statistics.median(v["decode"]) for k, v in res.items()},
        "prefill_tok_s": {k: statistics.median(v["prefill"]) for k, v in res.items()},
        "decode_runs": {k: stats(v["decode"]) for k, v in res.items()},
        "prefill_runs": {k: stats(v["prefill"]) for k, v in res.items()},
        "roofline_decode_tok_s": bw / decode_bytes_per_token(cfg),
        "matvec_gb_s": bw / 1e9,
        "matvec_runs": stats([x / 1e9 for x in bandwidth]),
        "compile_s": compile_s,
        "first_call_s": {k: v["compile_s"] for k, v in res.items() if "compile_s" in v},
        "model": {
            "architecture": cfg.architecture,
            "params": n_params,
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size,
            "dtype": "float32",
            "prompt": prompt_len,
            "new_tokens": new,
            "batch": 1,
        },
    }


def _report(cfg: LlamaConfig, out: dict[str, Any], prefetch: Any) -> None:
    """Print the markdown table, the roofline and compile figures, and the prefetch table."""
    roof, d, compile_s = out["roofline_decode_tok_s"], out["decode_tok_s"], out["compile_s"]
    print("\n| system | decode tok/s | share of roofline | prefill tok/s |")
    print("|---|---|---|---|")
    for k in d:
        print(f"| {k} | {d[k]:.1f} | {d[k] / roof:.0%} | {out['prefill_tok_s'][k]:.0f} |")
    print(
        f"\nroofline: {roof:.1f} tok/s ({out['matvec_gb_s']:.1f} GB/s "
        f"matvec / {decode_bytes_per_token(cfg) / 1e6:.1f} MB per token)"
    )
    print(
        f"compiled decode vs transformers eager: {d['fnpu_compiled'] / d['hf_eager']:.2f}x, "
        f"vs transformers compiled: {d['fnpu_compiled'] / d['hf_compiled']:.2f}x"
    )
    print(
        f"compile (fresh process, load + compile + first generate): cold {compile_s['cold']:.1f}s, "
        f"warm {compile_s['warm']:.1f}s ({compile_s['warm'] / compile_s['cold']:.0%} of cold)"
    )
    print("\npeers on 2 gloo ranks (one thread each):")
    print(peers_report(out["peers"]))
    print("\nlayer-sharded decode, plain loopback (2 gloo ranks, dp = 2, one thread each):")
    print(prefetch_table(prefetch["loopback"]))
    if prefetch["emulated"] is None:
        print(f"\n{prefetch['skipped']}")
    else:
        print(
            f"\nthe same on an emulated link of {prefetch['rate_bits'] / 1e9:.2f} Gbit/s (tc tbf, private namespace):"
        )
        print(prefetch_table(prefetch["emulated"]))


def _write(out: dict[str, Any], json_path: str | None, plot_dir: str | None) -> None:
    """The PNG plots under ``plot_dir`` and the JSON at ``json_path``, each if given."""
    if plot_dir:
        Path(plot_dir).mkdir(parents=True, exist_ok=True)
        made = [formats_plot(out["formats"], str(Path(plot_dir) / "formats.png"))]
        if "prefetch" in out:
            made.append(scoreboard_plot(out, str(Path(plot_dir) / "scoreboard.png")))
            made.append(
                prefetch_plot(out["prefetch"], str(Path(plot_dir) / "prefetch.png"), out["emulated_link"]["emulated"])
            )
        print(f"plots: {plot_dir}/ ({len(made)} PNG)" if all(made) else "plots: skipped (pip install matplotlib)")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks bench [flags]``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks bench",
        description="the scoreboard: this library vs transformers, eager and compiled (needs transformers)",
    )
    parser.add_argument(
        "--formats-only",
        action="store_true",
        help="only decode tokens/s by weight format (fp32, bf16, int8, int4; JSON key formats)",
    )
    parser.add_argument(
        "--peers-only",
        action="store_true",
        help="only the distributed peers on 2 gloo ranks: reshard vs DTensor.redistribute, decode at tp 2 vs "
        "transformers' tp_plan='auto' (JSON key peers)",
    )
    parser.add_argument("--quick", action="store_true", help="a 4-layer model and fewer tokens")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument(
        "--plots", metavar="DIR", default=None, help="write scoreboard.png and prefetch.png here (needs matplotlib)"
    )
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        parser.error("bench compares against transformers: pip install -e '.[bench]'")
    run_bench(
        quick=args.quick,
        json_path=args.json,
        plot_dir=args.plots,
        formats_only=args.formats_only,
        peers_only=args.peers_only,
    )
    return 0
