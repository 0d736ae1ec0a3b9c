"""Served tokens/s on a stream of requests: this library's engine against transformers' continuous batching and
against this library's lockstep ``generate``, on the same requests and weights.

**The workload** (seeded): ``--requests`` requests (default 64), prompts of uniform length in [16, 512] tokens
(uniform random ids), outputs ended by a stop id: request ``i`` gets a target length ``L_i = 16 + G_i`` with
``G_i`` geometric of mean 48, capped at ``--max-new`` (default 160), and its stop id is the token its greedy
continuation (this library's lockstep run) has at position ``L_i``; so a request stops at ``L_i`` tokens or at the
first earlier place that token comes up, and every system gets the same stop id and cap. All requests arrive at
once.

**The systems** (each as its users run it at its best on this CPU):

- ``engine``: :class:`functional_npu.runtime.serving.Engine` over the model compiled with inductor (batch buckets
  1-16, prefill chunk 128), the KV pool sized to hold every request's full length;
- ``transformers_cb``: transformers' continuous batching (``init_continuous_batching``: its paged attention and
  scheduler, default configuration), each request added with its own ``max_new_tokens`` and ``eos_token_id``;
- ``lockstep``: this library's ``CompiledModel.generate`` over all prompts at the largest cap (chunks of the largest
  batch bucket, every row to the same length: no stop id), its served tokens counted up to each request's stop.

Reported per system: served (generated) tokens/s over the wall time from the first request to the last token
(median and spread of interleaved rounds, the ratios taken round by round), and for the engine and transformers the
time to first token and time per output token per request (p50, p99).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from functional_npu import Mesh, compile_model, load_checkpoint, save_checkpoint
from functional_npu.models.llama import init_params
from functional_npu.runtime.serving import Engine, Request

from .configs import FULL, QUICK
from .flags import count
from .timing import pin_threads, ratio, rounds, stats

__all__ = ["workload", "run_serve", "serve_table", "main"]


def workload(n: int, vocab: int, max_new: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """``n`` prompts (uniform lengths in [16, 512]) and their target output lengths (16 + geometric of mean 48,
    capped at ``max_new``)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 513, (n,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]
    p = 1 / 48
    u = torch.rand(n, generator=g).tolist()
    targets = [min(max_new, 16 + int(math.log(1 - x) / math.log(1 - p))) for x in u]
    return prompts, targets


def _stops(reference: list[list[int]], targets: list[int]) -> tuple[list[int], list[int]]:
    """Each request's stop id (its greedy token at its target length) and the length it then stops at."""
    stops = [ref[t - 1] for ref, t in zip(reference, targets)]
    served = [ref.index(s) + 1 for ref, s in zip(reference, stops)]
    return stops, served


def _engine_run(model: Any, prompts: list[list[int]], stops: list[int], cap: int, blocks: int) -> dict[str, Any]:
    engine = Engine(model, blocks=blocks, block_size=16, chunk=128)
    requests = [Request(tuple(p), max_new_tokens=cap, stop=(s,)) for p, s in zip(prompts, stops)]
    t0 = time.perf_counter()
    first, last, count = {}, {}, {}
    for event in engine.run(requests):
        now = time.perf_counter() - t0
        if event.tokens:
            first.setdefault(event.id, now)
            last[event.id] = now
            count[event.id] = count.get(event.id, 0) + len(event.tokens)
    wall = time.perf_counter() - t0
    return _latency(wall, first, last, count)


def _latency(wall: float, first: dict, last: dict, count: dict) -> dict[str, Any]:
    tpot = [(last[i] - first[i]) / (count[i] - 1) for i in count if count[i] > 1]
    return {
        "wall_s": wall,
        "tokens": sum(count.values()),
        "tokens_per_s": sum(count.values()) / wall,
        "ttft_s": _percentiles(list(first.values())),
        "tpot_s": _percentiles(tpot),
    }


def _percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {}
    return {"p50": statistics.median(xs), "p99": xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]}


def _lockstep_run(model: Any, prompts: list[list[int]], served: list[int], cap: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    model.generate(prompts, cap)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(served), "tokens_per_s": sum(served) / wall}


def _hf_model(path: str) -> Any:
    import transformers as T

    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _transformers_cb(model: Any, prompts: list[list[int]], stops: list[int], cap: int) -> dict[str, Any]:
    import transformers as T

    config = T.GenerationConfig(do_sample=False, max_new_tokens=cap, eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    with torch.no_grad():
        manager = model.init_continuous_batching(generation_config=config)
        manager.start()
        ids = [
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=cap, eos_token_id=s, record_timestamps=True)
            for i, (p, s) in enumerate(zip(prompts, stops))
        ]
        results = {}
        while len(results) < len(ids):
            out = manager.get_result(timeout=600)
            if out is not None and out.is_finished():
                results[out.request_id] = out
        manager.stop(block=True)
    wall = time.perf_counter() - t0
    count = {i: len(r.generated_tokens) for i, r in results.items()}
    stamps = {i: (r.timestamps or [], r.created_time) for i, r in results.items()}  # from the request's creation
    first = {i: s[0] - at for i, (s, at) in stamps.items() if s}
    last = {i: s[-1] - at for i, (s, at) in stamps.items() if s}
    return _latency(wall, first, last, count) if first else {"wall_s": wall, "tokens": sum(count.values()),
                                                            "tokens_per_s": sum(count.values()) / wall}  # fmt: skip


def run_serve(*, quick: bool, requests: int, max_new: int, repeat: int, seed: int = 0) -> dict[str, Any]:
    """Build, warm, then ``repeat`` interleaved rounds of the three systems; the figures (JSON-ready)."""
    cfg = QUICK if quick else FULL
    cfg = dataclasses.replace(cfg, max_position_embeddings=1024)
    cores = pin_threads(None)
    prompts, targets = workload(requests, cfg.vocab_size, max_new, seed)
    one = Mesh.abstract({"tp": 1}, 0)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(init_params(cfg, seed=0), tmp)
        shapes = dict(batch_sizes=[1, 2, 4, 8, 16], max_seq_len=512 + max_new, prefill_lengths=[128, 512])
        model = compile_model(load_checkpoint(tmp, one), one, backend="inductor", **shapes)
        reference = model.generate(prompts, max_new)  # the lockstep run: each request's greedy continuation
        stops, served = _stops(reference, targets)
        blocks = 1 + sum(math.ceil((len(p) + max_new) / 16) for p in prompts)
        hf = _hf_model(tmp)
        systems = {
            "engine": lambda: _engine_run(model, prompts, stops, max_new, blocks),
            "transformers_cb": lambda: _transformers_cb(hf, prompts, stops, max_new),
            "lockstep": lambda: _lockstep_run(model, prompts, served, max_new),
        }
        systems["engine"]()  # warm: every bucket's graphs compiled before timing
        _transformers_cb(hf, prompts[:4], stops[:4], 8)  # and transformers' manager warmed once
        runs = rounds(systems, repeat)
    rates = {name: [r["tokens_per_s"] for r in rs] for name, rs in runs.items()}
    return {
        "model": {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "dtype": "float32"},
        "cores": cores,
        "workload": {
            "requests": requests,
            "prompt_tokens": {
                "min": min(map(len, prompts)),
                "max": max(map(len, prompts)),
                "mean": statistics.mean(map(len, prompts)),
            },  # fmt: skip
            "served_tokens": {"min": min(served), "max": max(served), "mean": statistics.mean(served)},
            "cap": max_new,
        },
        "runs": runs,
        "tokens_per_s": {name: stats(v) for name, v in rates.items()},
        "ratios": {
            "engine_over_transformers_cb": ratio(rates["engine"], rates["transformers_cb"]),
            "engine_over_lockstep": ratio(rates["engine"], rates["lockstep"]),
        },
    }


def serve_table(out: dict[str, Any]) -> str:
    rows = ["| system | served tok/s, median (min-max) | TTFT p50 / p99 s | TPOT p50 / p99 ms |", "|---|---|---|---|"]
    for name, s in out["tokens_per_s"].items():
        last = out["runs"][name][-1]
        ttft = last.get("ttft_s") or {}
        tpot = last.get("tpot_s") or {}
        rows.append(
            f"| {name} | {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) | "
            f"{ttft.get('p50', float('nan')):.2f} / {ttft.get('p99', float('nan')):.2f} | "
            f"{1e3 * tpot.get('p50', float('nan')):.1f} / {1e3 * tpot.get('p99', float('nan')):.1f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks serve", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 4-layer model and 16 requests")
    parser.add_argument("--requests", type=int, default=None, help="requests in the workload (default 64)")
    parser.add_argument("--max-new", type=int, default=160, help="the cap on new tokens per request")
    parser.add_argument("--repeat", type=count, default=3, help="interleaved rounds")
    parser.add_argument("--json", default=None, help="write the figures here (a file path)")
    args = parser.parse_args(argv)
    requests = args.requests or (16 if args.quick else 64)
    out = run_serve(quick=args.quick, requests=requests, max_new=args.max_new, repeat=args.repeat)
    print(serve_table(out))
    print(json.dumps(out["ratios"], indent=1))
    if args.json:
        path = Path(args.json)
        if path.is_dir():
            raise SystemExit(f"--json {path}: a directory; give a file path")
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)
    return 0
