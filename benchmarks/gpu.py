"""The GPU script: ``python -m benchmarks gpu [--json FILE] [--repeat N] [--deadline S] [--no-tests] [--tests T]
[--formats F] [--real MODEL] [--real-formats F] [--ring L]``.

One command for a machine with one NVIDIA GPU, run from the repository root with the torch that machine has (the
package is imported from the tree, nothing is installed, nothing is downloaded). Within ``--deadline`` seconds
(default 420) it

1. records the machine (GPU, torch, CUDA, transformers);
2. samples the **roofline**: a plain streaming read over a 2 GiB buffer (bytes/s) and a matrix product's peak at
   8192^3 in float32 and bfloat16 (FLOP/s), each the best of 10 timed with CUDA events; and the host link
   (:func:`host_link`: pinned and pageable host-to-device copies, and a pinned copy beside compute in one CUDA graph);
3. runs the **tests that need CUDA** (``tests/cuda``: params loaded onto the GPU, prefill and decode compiled with
   inductor and captured as CUDA graphs, tokens equal to transformers' on the same GPU, graphs replayed with no
   re-recording, skip or recompile, seeded sampling) in a pytest subprocess;
4. runs a model of **released shapes** (``--real``, default Qwen3-8B's, :data:`benchmarks.configs.REAL`) in bf16
   (``--real-formats``), built on the GPU with random weights (:mod:`benchmarks.real_shapes`, nothing downloaded):
   batches 1, 8 and 32, this library against transformers compiled as in the scoreboard below, each system's cold
   compile timed; skipped in one line naming the memory it needs when the GPU has less free. int8 / int4 have no
   CUDA kernel in this library (they are dequantized there), so they are named as skipped, not measured;
5. runs the **scoreboard**: the benchmarks' 70.5M-parameter Qwen3-style model (:data:`benchmarks.configs.FULL`)
   in fp32 and bf16 at batches 1, 8 and 32, this library in its default configuration on CUDA (``compile_model``
   with no mode: inductor with CUDA graphs) against transformers' ``generate`` compiled with a static cache (its
   own default compile on CUDA, CUDA graphs too), in interleaved rounds (:func:`benchmarks.timing.interleaved`),
   the read bandwidth sampled between rounds. Each cell's share is of ``max(bytes / read, FLOPs / peak)`` for
   one step (weights, plus the KV cache it reads; 2 FLOPs per weight and token plus attention's), and the term
   that binds is named;
6. runs the **ring from host memory** (``--ring`` layers of the ``--real`` model's shapes, default 4; 0 skips;
   :func:`benchmarks.ring_gpu.ring_cell`): the model resident, and with ``o_proj`` in pinned host memory at prefetch
   steps 0 and 1, tokens equal to the resident model's, the copy time hidden under compute per phase (a 2048-token
   prefill, decode steps), and the host copies counted on the device (bytes, and the streams they ran on).

The JSON is rewritten after every phase, so a run cut short keeps what it measured. Without CUDA it says so in
one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from functional_npu.core import Mesh
from functional_npu.models.llama import LlamaConfig
from functional_npu.runtime.serving import cache_length, compile_model

from .configs import FULL, REAL
from .flags import count
from .formats import decode_bytes, fnpu_runner, hf_runner, transformers_runner, write_formats
from .real_shapes import available_bytes, device_params, needed_bytes, param_count, peer_model, refusal
from .ring_gpu import ring_cell
from .roofline import step_cost, step_floor
from .timing import interleaved, ratio, stats

__all__ = ["main", "gpu_cells", "real_format", "measured"]

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 8, 32)
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROMPT = 32
# formats of the real-size cell with no CUDA kernel here, and why none is measured
REAL_FORMATS_WHY = {
    fmt: f"{fmt}: no CUDA kernel for it in this library (prepare(target='dense') dequantizes {fmt} weights to bf16 on "
    "CUDA), so the cell would measure bf16 under another name"
    for fmt in ("int8", "int4")
}


def _events_seconds(fn: Any, repeat: int = 10) -> float:
    """The fastest of ``repeat`` timings of ``fn()`` with CUDA events (after one untimed call)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def read_bandwidth(gib: int = 2) -> float:
    """Bytes/s of a plain streaming read on the GPU: a sum over a float32 buffer of ``gib`` GiB."""
    x = torch.rand(gib * 2**28, device="cuda")
    return x.numel() * 4 / _events_seconds(x.sum)


def gemm_peak(dtype: torch.dtype, n: int = 8192) -> float:
    """FLOP/s of an ``n``-cubed matrix product of random ``dtype`` operands."""
    a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
    return 2 * n**3 / _events_seconds(lambda: a @ b)


def host_link(mib: int = 256, repeat: int = 10) -> dict[str, Any]:
    """The host-to-device link a ring filled from host memory would use: bytes/s of one ``mib`` MiB copy from pinned
    and from pageable host memory, and whether a pinned copy on a side stream overlaps compute inside one captured CUDA
    graph (replay ms of the compute alone, the copy alone, and both, the copy joined back by an event)."""
    n = mib * 2**20 // 2
    pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True).fill_(1.0)
    pageable, slot = torch.ones(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    out = {"mib": mib,
           "pinned_gb_s": n * 2 / _events_seconds(lambda: slot.copy_(pinned, non_blocking=True), repeat) / 1e9,
           "pageable_gb_s": n * 2 / _events_seconds(lambda: slot.copy_(pageable), repeat) / 1e9}  # fmt: skip
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def compute() -> None:
        for _ in range(4):
            torch.mm(a, a)

    def copy_beside(with_compute: bool) -> None:
        ready = torch.cuda.Event()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            slot.copy_(pinned, non_blocking=True)
            ready.record(side)
        if with_compute:
            compute()
        torch.cuda.current_stream().wait_event(ready)

    for name, fn in {"compute": compute, "copy": lambda: copy_beside(False), "both": lambda: copy_beside(True)}.items():
        g = torch.cuda.CUDAGraph()
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            fn()
        out[f"graph_{name}_ms"] = _events_seconds(g.replay, repeat) * 1e3
    out["slot_equal"] = bool(torch.equal(slot.cpu(), pinned))
    out["hidden_share"] = (out["graph_compute_ms"] + out["graph_copy_ms"] - out["graph_both_ms"]) / min(
        out["graph_compute_ms"], out["graph_copy_ms"]
    )
    return out


def environment() -> dict[str, Any]:
    import transformers

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }


def run_tests(timeout: float, which: str = "tests/cuda") -> dict[str, Any]:
    """``pytest tests/cuda`` (or ``which``) in a subprocess: its exit code, summary line and the output's tail
    (failures in short form, no captured logs)."""
    cmd = [sys.executable, "-m", "pytest", *which.split(), "-q", "-p", "no:cacheprovider", "-p", "no:logging",
           "-o", "addopts=", "-rfEs", "--tb=short"]  # fmt: skip
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, out = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else ""
    lines = [x for x in out.splitlines() if x.strip()]
    return {"exit": code, "summary": lines[-1] if lines else "", "seconds": time.perf_counter() - t0,
            "tail": "\n".join(lines[-60:])}  # fmt: skip


def gpu_cells(fmt: str, decode: dict, cost: dict, reads: list[float], peak: float) -> dict[str, Any]:
    """Each batch of one format: our tok/s, the share of the memory-and-compute roofline and the ratio to
    transformers compiled, round by round; the binding term."""
    out = {}
    for b, ours in decode[f"fnpu_{fmt}"].items():
        nbytes, flops = cost[b]
        floors = [step_floor(nbytes, flops, r, peak) for r in reads]
        roof = [int(b) / t for t, _ in floors]
        out[b] = {
            "tok_s": stats(ours),
            "roofline_tok_s": stats(roof),
            "share_of_roofline": ratio(ours, roof),
            "binds": floors[0][1],
            "peers": {f"hf_{fmt}": ratio(ours, decode[f"hf_{fmt}"][b])},
            "step_bytes": nbytes,
            "step_flops": flops,
        }
    return out


def scoreboard_format(
    fmt: str, path: Path, repeat: int, new: int, peak: float, log: Any, device: str = "cuda"
) -> dict[str, Any]:
    """One format's interleaved rounds: ours against transformers compiled, the read bandwidth between rounds."""
    prompt = [(7 * i) % FULL.vocab_size for i in range(1, PROMPT + 1)]
    mesh = Mesh.abstract({"tp": 1}, 0)
    ours, model = fnpu_runner(path, mesh, prompt, new, batch_sizes=BATCHES, device=device)
    hf = transformers_runner(path, prompt, FORMATS[fmt], compile_config={}, device=device)
    return measured(FULL, fmt, {f"fnpu_{fmt}": ours, f"hf_{fmt}": hf}, model, repeat, new, peak, log, device)


def real_format(
    cfg: LlamaConfig,
    fmt: str,
    repeat: int,
    new: int,
    peak: float,
    log: Any,
    *,
    device: str = "cuda",
    batches: tuple[int, ...] = BATCHES,
    read: Any = None,
) -> dict[str, Any]:
    """A model of released shapes (``cfg``, :data:`benchmarks.configs.REAL`) in format ``fmt``, built on ``device``
    with random weights (:mod:`benchmarks.real_shapes`): ours against transformers compiled, as
    :func:`scoreboard_format`, with each system's build and cold compile time. ``{"skipped": why}`` in one line when
    the device lacks the memory for both; ``read``: the bandwidth probe (default :func:`read_bandwidth`)."""
    dtype = FORMATS[fmt]
    need = needed_bytes(cfg, dtype, max(batches), cache_length(PROMPT + new))
    why = refusal(f"{cfg.num_layers}-layer {fmt} model", need, available_bytes(device), device)
    if why is not None:
        return {"skipped": why}
    prompt = [(7 * i) % cfg.vocab_size for i in range(1, PROMPT + 1)]
    t0 = time.perf_counter()
    params = device_params(cfg, dtype, device)
    model = compile_model(
        params, Mesh.abstract({"tp": 1}, 0), batch_sizes=list(batches), max_seq_len=cache_length(PROMPT + new)
    )
    built = {f"fnpu_{fmt}": time.perf_counter() - t0}
    t0 = time.perf_counter()
    hf = hf_runner(peer_model(cfg, dtype, device), prompt, compile_config={}, device=device)
    built[f"hf_{fmt}"] = time.perf_counter() - t0
    systems = {f"fnpu_{fmt}": lambda b, n: model.generate([prompt] * b, n), f"hf_{fmt}": hf}
    res = measured(cfg, fmt, systems, model, repeat, new, peak, log, device, batches, read)
    return res | {"model": cfg.to_hf(), "params": param_count(cfg), "build_s": built}


def measured(
    cfg: LlamaConfig,
    fmt: str,
    systems: dict[str, Any],
    model: Any,
    repeat: int,
    new: int,
    peak: float,
    log: Any,
    device: str = "cuda",
    batches: tuple[int, ...] = BATCHES,
    read: Any = None,
) -> dict[str, Any]:
    """Warm every system at every batch (each one's first calls timed: its cold compile), then ``repeat``
    interleaved rounds with the read bandwidth sampled between them; the cells against the roofline and the peer."""
    read = read or read_bandwidth
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    systems = {name: (lambda b, n, run=run: (run(b, n), sync())) for name, run in systems.items()}
    t0, compile_s = time.perf_counter(), {}
    for name, run in systems.items():
        t = time.perf_counter()
        for b in batches:
            run(b, new)
            run(b, 1)
        compile_s[name] = time.perf_counter() - t
        log(f"  gpu: {name} built and warm ({compile_s[name]:.0f} s)")
    reads = [read()]
    runs = interleaved(systems, batches, new, PROMPT, repeat, lambda r: reads.append(read()))
    decode = {s: {str(b): v["decode"] for b, v in per.items()} for s, per in runs.items()}
    elem = FORMATS[fmt].itemsize
    cost = {str(b): step_cost(cfg, decode_bytes(model.params), elem, b, PROMPT, new) for b in batches}
    round_read = [(a + b) / 2 for a, b in zip(reads, reads[1:])]
    profiles = {name: profile_decode(run, 1, new) for name, run in systems.items()}
    return {
        "profile_batch1": profiles,
        "systems": {name: {b: stats(v) for b, v in per.items()} for name, per in decode.items()},
        "decode_runs": decode,
        "read_gb_s": stats([r / 1e9 for r in reads]),
        "cells": gpu_cells(fmt, decode, cost, round_read, peak),
        "warm_s": compile_s,
        "build_s": time.perf_counter() - t0,
    }


def profile_decode(run: Any, b: int, new: int) -> dict[str, Any]:
    """Where one generate's time goes (``torch.profiler``, CPU and the device): its wall time, the device's busy
    time, and the ops that take the most of each, so a step far from the roofline says why."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    run(b, new)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run(b, new)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()

    def device_us(e: Any) -> float:
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))

    def top(key: Any, n: int) -> list[dict[str, Any]]:
        rows = sorted(events, key=key, reverse=True)[:n]
        return [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                 "self_device_ms": device_us(e) / 1e3} for e in rows]  # fmt: skip

    return {
        "batch": b,
        "new_tokens": new,
        "wall_ms": wall * 1e3,
        "device_busy_ms": sum(device_us(e) for e in events) / 1e3,
        "top_cpu": top(lambda e: e.self_cpu_time_total, 12),
        "top_device": top(device_us, 8),
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "gpu.json"), help="where the JSON goes")
    p.add_argument("--repeat", type=count, default=5, help="interleaved rounds per format (default 5)")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds the whole run may take (default 420)")
    p.add_argument("--new", type=int, default=32, help="new tokens per generate (default 32)")
    p.add_argument("--no-tests", action="store_true", help="skip tests/cuda")
    p.add_argument("--tests", default="tests/cuda", help="the tests to run (default tests/cuda)")
    p.add_argument("--formats", default=",".join(FORMATS), help="the scoreboard's formats (default fp32,bf16)")
    p.add_argument("--real", default="qwen3-8b", choices=[*REAL, "none"], help="a model of released shapes, run "
                   "before the scoreboard (default qwen3-8b; none: skip)")  # fmt: skip
    p.add_argument("--real-formats", default="bf16", help="its formats (default bf16)")
    p.add_argument("--ring", type=int, default=4, help="layers of the ring-from-host-memory cell, run last (default 4; "
                   "0: skip)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("python -m benchmarks gpu: no CUDA GPU here (torch.cuda.is_available() is False); run it on a "
              "machine with one NVIDIA GPU", file=sys.stderr)  # fmt: skip
        return 2
    t0, out = time.perf_counter(), Path(args.json)
    res: dict[str, Any] = {"environment": environment(), "settings": vars(args) | {"batches": list(BATCHES)}}

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1) + "\n")

    res["roofline"] = {"read_gb_s": read_bandwidth() / 1e9}
    res["roofline"] |= {f"gemm_tflops_{f}": gemm_peak(dt) / 1e12 for f, dt in FORMATS.items()}
    print(f"gpu: {res['environment']}\n  roofline: {res['roofline']}", flush=True)
    res["host_link"] = host_link()
    print(f"  host link: {res['host_link']}", flush=True)
    save()
    if not args.no_tests:
        res["tests"] = run_tests(timeout=max(60.0, 0.4 * args.deadline), which=args.tests)
        print(f"  tests/cuda: exit {res['tests']['exit']}: {res['tests']['summary']}", flush=True)
        save()
    res["decode"], res["skipped"], res["real"] = {}, {}, {}
    for fmt in [f for f in args.real_formats.split(",") if f] if args.real != "none" else []:
        key, left = f"{args.real} {fmt}", args.deadline - (time.perf_counter() - t0)
        if fmt not in FORMATS:
            res["skipped"][key] = REAL_FORMATS_WHY.get(fmt, f"no such format; one of {', '.join(FORMATS)}")
        elif left < 120:
            res["skipped"][key] = f"deadline: {left:.0f} s left"
        else:
            try:
                got = real_format(
                    REAL[args.real], fmt, args.repeat, args.new, res["roofline"][f"gemm_tflops_{fmt}"] * 1e12, _log
                )
            except Exception as e:  # noqa: BLE001 - one cell's failure is recorded, the next still runs
                got = {"skipped": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
            if "skipped" in got:
                res["skipped"][key] = got["skipped"]
            else:
                res["real"][key] = got
        save()
        print(f"  {key}: {res['skipped'].get(key) or _cells_line(res['real'][key])}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_formats(FULL, Path(tmp))
        for fmt in [f for f in args.formats.split(",") if f]:
            left = args.deadline - (time.perf_counter() - t0)
            if left < 60:
                res["skipped"][fmt] = f"deadline: {left:.0f} s left"
                continue
            peak = res["roofline"][f"gemm_tflops_{fmt}"] * 1e12
            try:
                res["decode"][fmt] = scoreboard_format(fmt, paths[fmt], args.repeat, args.new, peak, _log)
            except Exception as e:  # noqa: BLE001 - one format's failure is recorded, the next still runs
                res["skipped"][fmt] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
            save()
            _print_cells(fmt, res)
    if args.ring > 0:
        left = args.deadline - (time.perf_counter() - t0)
        cfg = REAL["qwen3-8b" if args.real == "none" else args.real]
        try:
            ring = {"skipped": f"deadline: {left:.0f} s left"} if left < 120 else None
            res["ring"] = ring or ring_cell(cfg, layers=args.ring, log=_log)
        except Exception as e:  # noqa: BLE001 - recorded, as a cell's failure is
            res["ring"] = {"skipped": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
        if "skipped" in res["ring"]:
            res["skipped"]["ring"] = res["ring"]["skipped"]
        print(f"  ring: {res['ring'].get('skipped') or res['ring']['phases']}", flush=True)
    res["seconds"] = time.perf_counter() - t0
    save()
    return 0 if res.get("tests", {}).get("exit", 0) == 0 and not res["skipped"] else 1


def _cells_line(res: dict[str, Any]) -> str:
    return "; ".join(
        f"b={b}: {c['tok_s']['median']:.0f} tok/s, {c['share_of_roofline']['median']:.1%} of the roofline "
        f"({c['binds']}), {next(iter(c['peers'].values()))['median']:.2f}x transformers compiled"
        for b, c in res["cells"].items()
    )


def _log(msg: str) -> None:
    print(msg, flush=True)


def _print_cells(fmt: str, res: dict[str, Any]) -> None:
    if fmt not in res["decode"]:
        print(f"  {fmt}: not run ({res['skipped'].get(fmt)})", flush=True)
        return
    for b, c in res["decode"][fmt]["cells"].items():
        peer = next(iter(c["peers"].values()))
        print(f"  {fmt} b={b}: {c['tok_s']['median']:.0f} tok/s, {c['share_of_roofline']['median']:.1%} of the "
              f"roofline ({c['binds']}), {peer['median']:.2f}x transformers compiled", flush=True)  # fmt: skip
