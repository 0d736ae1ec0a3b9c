"""The planner on paper: the plan it picks for large models on Ascend nodes, from published figures.

    python -m benchmarks planner_paper [--markdown docs/planner_table.md]

Qwen3-8B and 32B, Llama-3-70B (bf16) and DeepSeek-V3 (W8A8: int8 weights per channel, int8 activations per
token, as it is served on Ascend), on 8 x 910B and 16 x 910C dies, at decode (batch 64, context 4096) and prefill
(one 4096-token prompt), each at the device's whole memory and at half of it. Each cell is the chosen plan, its
modelled step and the bytes on its busiest rank, or the smallest memory any plan needs where none fits. The
configs are the published ``config.json`` sizes (no download); the device figures and their sources are
:data:`functional_npu.parallel.devices.DEVICES`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from functional_npu.core import Quant
from functional_npu.models import family_of
from functional_npu.parallel import device
from functional_npu.placement import QuantConfig
from functional_npu.runtime.planning import PlanDoesNotFit, Workload, choose_plan

# published config.json sizes (the fields the families read)
MODELS = {
    "Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 40960,
    },
    "Qwen3-32B": {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 40960,
    },
    "Llama-3-70B": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 5e5,
        "max_position_embeddings": 8192,
    },
}
W8A8 = QuantConfig.of(Quant(8, "channel", activations="token"))
SETUPS = (("ascend-910b", 8), ("ascend-910c", 16))
WORKLOADS = (("decode b64 c4096", Workload.decode(64, 4096)), ("prefill 4096", Workload.prefill(4096)))


def _deepseek_v3() -> dict:
    import transformers as T

    hf = T.DeepseekV3Config().to_dict()  # its defaults are DeepSeek-V3's published sizes, but for its positions
    return hf | {"architectures": ["DeepseekV3ForCausalLM"], "max_position_embeddings": 163840}


def cells() -> list[dict]:
    """One row per (model, devices, workload, budget)."""
    rows = []
    models = {name: (hf, None) for name, hf in MODELS.items()} | {"DeepSeek-V3 (W8A8)": (_deepseek_v3(), W8A8)}
    for name, (hf, quant) in models.items():
        cfg = family_of(hf["architectures"][0]).from_hf(hf)
        for dev_name, n in SETUPS:
            dev = device(dev_name)
            for wname, work in WORKLOADS:
                for share in (1.0, 0.5):
                    memory = dev.memory_bytes * share
                    row = {"model": name, "devices": f"{n} x {dev_name}", "workload": wname, "memory_gb": memory / 1e9}
                    try:
                        chosen, report = choose_plan(cfg, n, dev, memory, work, quant=quant)
                        best = report.chosen
                        row |= {
                            "plan": best.candidate.name,
                            "prefetch_step": chosen.plan.prefetch_step if chosen.plan.layer_shard else None,
                            "step_ms": best.step_s * 1e3,
                            "gb_per_rank": best.bytes["total"] / 1e9,
                            "candidates": len(report.ranked),
                            "fitting": sum(e.fits for e in report.ranked),
                        }
                    except PlanDoesNotFit as e:
                        row |= {"plan": None, "refusal": str(e).split("; ", 1)[1]}
                    rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | devices | workload | memory / device | chosen plan | step | GB / rank | fitting of candidates |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["plan"] is None:
            lines.append(
                f"| {r['model']} | {r['devices']} | {r['workload']} | {r['memory_gb']:.0f} GB | none fits: "
                f"{r['refusal']} | | | |"
            )
            continue
        k = f" (k = {r['prefetch_step']})" if r["prefetch_step"] is not None else ""
        lines.append(
            f"| {r['model']} | {r['devices']} | {r['workload']} | {r['memory_gb']:.0f} GB | {r['plan']}{k} "
            f"| {r['step_ms']:.3g} ms | {r['gb_per_rank']:.1f} | {r['fitting']} of {r['candidates']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks planner_paper", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", metavar="FILE", help="also write the table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    table = markdown(cells())
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0
