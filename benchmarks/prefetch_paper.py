"""Where layer sharding pays, on paper: the prefetch cost model with published device figures, for real
model sizes, at decode and prefill.

Each row states its assumptions. A layer's compute is its roofline on one device: reading the weights
that device holds for the layer once (decode), or ``2 * tokens * active params`` FLOPs (prefill);
attention's own FLOPs and the KV cache are left out, so compute is a lower bound and the exposure an
upper bound. The layer-sharded series is broadcast over ``n`` devices from its owner, once per layer
per step, at the device's link rate (:data:`functional_npu.parallel.prefetch_cost.DEVICES`).
``python -m benchmarks prefetch_paper`` prints the table.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from functional_npu.parallel import DEVICES, choose_k, exposed, roofline_layer_s

__all__ = ["Workload", "WORKLOADS", "paper_rows", "paper_table", "main"]


@dataclass(frozen=True)
class Workload:
    """One model's layer-sharded series on one device type, at one phase."""

    model: str
    series: str
    layers: int
    series_bytes: float  # one layer's series, as stored
    device_layer_bytes: float  # the weights one device reads per layer per step (its shard)
    active_params: float  # per layer, per token (the FLOPs' factor)
    tokens: int  # per device per step
    n: int  # devices the series is layer-sharded over
    device: str
    note: str


def _dense(h: int, inter: int, heads: int, kv: int, hd: int) -> tuple[float, float]:
    """(o_proj params, all params) of one dense layer."""
    qkv, o = h * (heads + 2 * kv) * hd, heads * hd * h
    return o, qkv + o + 3 * h * inter


_Q8_O, _Q8_ALL = _dense(4096, 12288, 32, 8, 128)  # Qwen3-8B
_L70_O, _L70_ALL = _dense(8192, 28672, 64, 8, 128)  # Llama-3-70B
_DS_O = 16384 * 7168  # DeepSeek-V3 o_proj (vllm-ascend RFC #3150: int8, 61 layers)
_DS_ATTN = 7168 * 1536 + 1536 * 24576 + 7168 * 576 + 512 * 32768 + _DS_O  # MLA projections
_DS_ACTIVE = 37e9 / 61  # 37B activated parameters over 61 layers

WORKLOADS = [
    *(
        Workload(
            "Qwen3-8B", "o_proj", 36, 2 * _Q8_O, 2 * _Q8_ALL, _Q8_ALL, t, 8, dev, "bf16, replicated per device (DP)"
        )
        for dev in ("ascend-910b", "h100-sxm")
        for t in (64, 4096)
    ),
    *(
        Workload("Llama-3-70B", "o_proj", 80, 2 * _L70_O / 8, 2 * _L70_ALL / 8, _L70_ALL / 8, t, 8, dev, "bf16, TP 8")
        for dev in ("ascend-910b", "h100-sxm")
        for t in (64, 4096)
    ),
    *(
        Workload(
            "DeepSeek-V3",
            "o_proj",
            61,
            _DS_O,
            _DS_ATTN,
            _DS_ACTIVE,
            t,
            8,
            "ascend-910b",
            "int8; decode compute = the MLA projections only (experts spread by EP)",
        )
        for t in (64, 4096)
    ),
]


def paper_rows(workloads: list[Workload] = WORKLOADS) -> list[dict[str, Any]]:
    """Per workload: per-layer compute and broadcast, the auto ``k``, its predicted exposure, and the
    series bytes a device saves against holding every layer."""
    rows = []
    for w in workloads:
        device = DEVICES[w.device]
        compute = roofline_layer_s(device, w.device_layer_bytes, 2.0 * w.tokens * w.active_params)
        comm = device.link.time(w.series_bytes)
        k = choose_k(int(w.series_bytes), num_layers=w.layers, compute_s=compute, link=device.link)
        held = (math.ceil(w.layers / w.n) + k + 1) * w.series_bytes
        rows.append(
            {
                "model": w.model,
                "series": w.series,
                "device": w.device,
                "tokens": w.tokens,
                "compute_ms": compute * 1e3,
                "broadcast_ms": comm * 1e3,
                "k": k,
                "exposed": exposed(w.layers, k, compute, w.series_bytes / device.link.bytes_per_s, comm),
                "saved_gb": (w.layers * w.series_bytes - held) / 1e9,
                "note": w.note,
            }
        )
    return rows


def paper_table(rows: list[dict[str, Any]] | None = None) -> str:
    rows = paper_rows() if rows is None else rows
    out = [
        "| model, series | device | tokens / step | compute / layer | broadcast / layer | auto k | "
        "predicted exposed | series bytes saved / device | assumptions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']}, {r['series']} | {r['device']} | {r['tokens']} | {r['compute_ms']:.3f} ms | "
            f"{r['broadcast_ms']:.3f} ms | {r['k']} | {r['exposed']:.0%} | {r['saved_gb']:.2f} GB | {r['note']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks prefetch_paper``: the table and the sources of its device figures."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks prefetch_paper", description=__doc__.splitlines()[0])
    parser.parse_args(argv)  # no flags: -h, or one line for anything else
    print(paper_table())
    print("\nsources: " + "; ".join(f"{d.name}: {d.source}" for d in DEVICES.values() if d.name != "host"))
