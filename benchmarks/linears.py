"""The linear kernels alone: ``python -m benchmarks linears [--repeat N] [--json FILE]``.

The scoreboard model's 49 linear weights (12 layers of ``[q|k|v]``, ``o_proj``, ``[gate|up]``, ``down``, and
``lm_head``) multiplied by ``b`` rows, for batches 1, 8 and 32, fp32 and bf16, each way a CPU can do it:

- ``matmul``: torch's matmul, ``x @ w.T``, compiled (the path ``compile_model(linear="matmul")`` takes);
- ``streamed``: this library's :func:`functional_npu.models.linear.streamed` (one reduction per row, fused into one
  pass over each weight), compiled, at every batch (the default takes it up to
  :func:`functional_npu.models.stream_rows` rows);
- ``onednn``: oneDNN's linear over weights prepacked for the batch (``mkldnn._reorder_linear_weight`` and
  ``mkldnn._linear_pointwise``), eager: the CPU's fastest kernel at 8 and 32 rows, which a compiled graph can
  call only on weights frozen into it as constants (a prepacked weight is an opaque ``torch._mkldnn`` tensor, and
  inductor refuses one as a graph input: :func:`onednn_as_input`).

Each figure is the median of ``repeat`` timings; the kinds of one batch and dtype run interleaved, and the
read bandwidth and the matmul peak are sampled beside them, so each figure is also a share of
``max(bytes / read, FLOPs / peak)``. This is the profile behind the scoreboard's batch-8 and batch-32 cells: how
much of a decode step the linears take, kernel by kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from functional_npu.models import streamed

from .configs import FULL
from .flags import count
from .formats import gemm_peak
from .roofline import step_floor
from .timing import pin_threads, read_bandwidth

__all__ = ["shapes", "run", "onednn_as_input", "main"]

BATCHES = (1, 8, 32)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shapes(cfg: Any = FULL) -> list[tuple[int, int]]:
    """``[(out, in)]`` of every linear weight of ``cfg`` (a Llama-family config), lm_head last."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = [(q + 2 * kv, cfg.hidden_size), (cfg.hidden_size, q), (2 * cfg.intermediate_size, cfg.hidden_size)]
    layer.append((cfg.hidden_size, cfg.intermediate_size))
    return layer * cfg.num_layers + [(cfg.vocab_size, cfg.hidden_size)]


def _kinds(ws: list[torch.Tensor], b: int) -> dict[str, Callable[[list[torch.Tensor]], Any]]:
    def over(lin: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
        return lambda xs, ws: [lin(x, w) for x, w in zip(xs, ws)]

    packed = [torch.ops.mkldnn._reorder_linear_weight(w, b) for w in ws]
    matmul = torch.compile(over(lambda x, w: x @ w.T), fullgraph=True)
    stream = torch.compile(over(streamed), fullgraph=True)

    def onednn(xs: list[torch.Tensor]) -> Any:
        return [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, packed)]

    return {"matmul": lambda xs: matmul(xs, ws), "streamed": lambda xs: stream(xs, ws), "onednn": onednn}


def onednn_as_input() -> str:
    """What inductor says to a prepacked oneDNN weight passed into a compiled graph (its first line)."""
    w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 32), 8)
    fn = torch.compile(lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") * 2, fullgraph=True)
    try:
        fn(torch.randn(8, 32), w)
    except Exception as e:  # noqa: BLE001 - whatever inductor raises is the finding
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    finally:
        torch._dynamo.reset()
    return "accepted"


def run(repeat: int = 7, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every kind at every batch and dtype: ``{dtype: {batch: {kind: {ms, share, binds}}}}``, with the read bandwidth
    and the matmul peaks sampled beside them, and the finding of :func:`onednn_as_input`."""
    cores = pin_threads(None)
    out: dict[str, Any] = {"cores": cores, "shapes": shapes(), "onednn_as_graph_input": onednn_as_input()}
    g = torch.Generator().manual_seed(0)
    for name, dt in DTYPES.items():
        ws = [(torch.randn(o, i, generator=g) * 0.02).to(dt) for o, i in shapes()]
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        out[name] = {}
        for b in BATCHES:
            xs = [torch.randn(b, w.shape[1], generator=g).to(dt) for w in ws]
            kinds = _kinds(ws, b)
            ref = kinds["matmul"](xs)
            for kind, fn in kinds.items():  # built and warm; each agrees with the matmul
                got = fn(xs)
                worst = max(float((a - r).float().abs().max() / r.float().abs().max()) for a, r in zip(got, ref))
                assert worst < (1e-5 if dt == torch.float32 else 2e-2), (name, b, kind, worst)
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(repeat):
                for kind, fn in kinds.items():
                    t0 = time.perf_counter()
                    fn(xs)
                    times[kind].append(time.perf_counter() - t0)
            read, peak = read_bandwidth(), gemm_peak(dt)
            flops = 2 * b * sum(w.numel() for w in ws)
            floor, binds = step_floor(nbytes, flops, read, peak)
            cell = {"read_gb_s": read / 1e9, "peak_gflop_s": peak / 1e9, "floor_ms": floor * 1e3, "binds": binds}
            for kind, ts in times.items():
                ms = statistics.median(ts) * 1e3
                cell[kind] = {"ms": ms, "min_ms": min(ts) * 1e3, "share": floor * 1e3 / ms}
            out[name][str(b)] = cell
            log(
                f"  {name} b={b}: floor {floor * 1e3:.1f} ms ({binds}); "
                + ", ".join(f"{k} {cell[k]['ms']:.1f} ms ({cell[k]['share']:.0%})" for k in kinds)
            )
            torch._dynamo.reset()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks linears", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=count, default=7, help="timings per kind, interleaved (default 7)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1, got {args.repeat}")
    res = run(args.repeat)
    print(f"oneDNN's prepacked weight as a compiled graph's input: {res['onednn_as_graph_input']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
