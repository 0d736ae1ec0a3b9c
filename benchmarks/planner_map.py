"""Where each technique pays, on paper: the serving planner over published models, devices, contexts and budgets.

    python -m benchmarks planner_map [--markdown docs/planner_map.md] [--json benchmarks/results/planner_map.json]

For each model (published ``config.json`` sizes, no download), each setup (8 x 910B, 16 x 910B on two nodes,
16 x 910C dies, 8 x H100), each context (4k, 32k positions; decode alone, and 4k with half the tokens prompt) and
each memory budget (the device's whole memory and half of it), :func:`~functional_npu.runtime.planning.choose_plan`
ranks every candidate by the tokens/s per device it serves at the batch the budget admits. Each cell records the
winner and, per technique (plain ``dp x tp``, expert parallelism, module TP, layer sharding, series kept in host
memory), its best candidate:
the bytes of weights (and ring) it holds against the plain split it starts from, the sequences that frees, and
the tokens/s that serves, against the communication it adds. The figures are the cost model's, on the device
profiles' published figures (:data:`functional_npu.parallel.devices.DEVICES`); nothing here is measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from functional_npu.models import family_of
from functional_npu.parallel import device
from functional_npu.runtime.planning import PlanDoesNotFit, Workload, choose_plan

from .planner_paper import MODELS, W8A8, _deepseek_v3

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "max_position_embeddings": 40960,
}
SETUPS = (("ascend-910b", 8), ("ascend-910b", 16), ("ascend-910c", 16), ("h100-sxm", 8))
WORKLOADS = (
    ("4k, decode", Workload.serve(4096)),
    ("4k, half prompt", Workload.serve(4096, 0.5)),
    ("32k, decode", Workload.serve(32768)),
)
TECHNIQUES = ("dp x tp", "EP", "module TP", "layer sharding", "offload")
NOT_RUN = ("two-batch overlap", "disaggregated")  # priced and ranked, never chosen: this library does not run them


def technique(candidate: Any) -> str:
    """The technique a candidate adds to its ``dp x tp`` split (or the schedule this library does not run)."""
    if candidate.name.startswith("disaggregated"):
        return "disaggregated"
    if candidate.schedule == "two_batch":
        return "two-batch overlap"
    plan = candidate.plan
    if plan.offload:
        return "offload"
    if plan.layer_shard is not None:
        return "layer sharding"
    if plan.module_tp:
        return "module TP"
    if plan.expert_axes:
        return "EP"
    return "dp x tp"


def models() -> dict[str, tuple[Any, Any]]:
    hf = {"Qwen3-8B": MODELS["Qwen3-8B"], "Qwen3-32B": MODELS["Qwen3-32B"], "Llama-3-70B": MODELS["Llama-3-70B"]}
    out = {name: (family_of(h["architectures"][0]).from_hf(h), None) for name, h in hf.items()}
    out["Qwen3-30B-A3B"] = (family_of("Qwen3MoeForCausalLM").from_hf(QWEN3_30B_A3B), None)
    ds = _deepseek_v3()
    out["DeepSeek-V3 (W8A8)"] = (family_of(ds["architectures"][0]).from_hf(ds), W8A8)
    return out


def cell(cfg: Any, quant: Any, dev_name: str, n: int, work: Workload, memory: float) -> dict[str, Any]:
    """One cell: the winner, and each technique's best candidate against the plain split it starts from."""
    try:
        _, report = choose_plan(cfg, n, device(dev_name), memory, work, quant=quant)
    except PlanDoesNotFit as e:
        return {"winner": None, "refusal": f"needs {e.figure} per device ({e.plan})"}
    plain = {tuple(e.candidate.axes.items()): e for e in report.ranked if technique(e.candidate) == "dp x tp"}
    best: dict[str, Any] = {}
    for e in report.ranked:  # ranked best first: the first of each technique is its best
        t = technique(e.candidate)
        if t in best or not e.fits:
            continue
        base = plain.get(tuple(e.candidate.axes.items())) or plain.get(_split_of(e))
        freed = (base.bytes["weights"] - e.bytes["weights"] - e.bytes["prefetch"]) if base else 0
        step = e.decode.decode if t == "disaggregated" else e.decode  # the decode side's step
        comm = sum(v for k, v in step.parts.items() if k not in ("memory_s", "compute_s", "fixed_s"))
        best[t] = {
            "plan": e.candidate.name,
            "batch": e.batch,
            "tokens_per_s_per_device": e.per_device,
            "freed_bytes": freed,
            "extra_sequences": e.batch - base.batch if base else 0,
            "exposed_comm_ms": comm * 1e3,
            "bottleneck": e.bottleneck,
        }
    w = report.chosen
    return {
        "winner": w.candidate.name,
        "technique": technique(w.candidate),
        "batch": w.batch,
        "tokens_per_s_per_device": w.per_device,
        "bottleneck": w.bottleneck,
        "best": best,
        "layer_shard_refused": sum("saves no memory" in why for _, why in report.refused),
    }


def _split_of(e: Any) -> tuple:
    """A module-TP candidate's mesh splits dp into sub-axes: the plain split has dp = their product."""
    axes = dict(e.candidate.axes)
    tp = axes.pop("tp", 1)
    dp = 1
    for v in axes.values():
        dp *= v
    return (("dp", dp), ("tp", tp))


def cells() -> list[dict[str, Any]]:
    rows = []
    for name, (cfg, quant) in models().items():
        for dev_name, n in SETUPS:
            dev = device(dev_name)
            for wname, work in WORKLOADS:
                if work.context > cfg.max_position_embeddings:
                    continue
                for share in (1.0, 0.5):
                    memory = dev.memory_bytes * share
                    row = {"model": name, "devices": f"{n} x {dev_name}", "workload": wname, "memory_gb": memory / 1e9}
                    rows.append(row | cell(cfg, quant, dev_name, n, work, memory))
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = "| model | devices | workload | memory | winner | seqs | tok/s/dev | bottleneck | "
    head += " | ".join(f"best {t}: tok/s/dev (seqs, freed GB)" for t in TECHNIQUES)
    head += " | " + " | ".join(f"{t} (not run): tok/s/dev" for t in NOT_RUN) + " |"
    lines = [head, "|---" * (8 + len(TECHNIQUES) + len(NOT_RUN)) + "|"]
    for r in rows:
        lead = f"| {r['model']} | {r['devices']} | {r['workload']} | {r['memory_gb']:.0f} GB |"
        if r["winner"] is None:
            lines.append(lead + f" none fits: {r['refusal']} |" + " |" * (3 + len(TECHNIQUES) + len(NOT_RUN)))
            continue
        cols = []
        for t in TECHNIQUES:
            b = r["best"].get(t)
            cols.append(
                "-"
                if b is None
                else f"{b['tokens_per_s_per_device']:.4g} ({b['batch']}, {b['freed_bytes'] / 1e9:+.2f})"
            )
        for t in NOT_RUN:
            b = r["best"].get(t)
            cols.append("-" if b is None else f"{b['tokens_per_s_per_device']:.4g}")
        lines.append(
            lead
            + f" {r['winner']} | {r['batch']} | {r['tokens_per_s_per_device']:.4g} | {r['bottleneck']} | "
            + " | ".join(cols)
            + " |"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """What the table says, counted from it: the winners by technique and by how much each beat the best plain
    ``dp x tp`` plan, and whether layer sharding ever beats module TP."""
    fitted = [r for r in rows if r["winner"] is not None]
    out = [f"- {len(fitted)} of {len(rows)} cells fit some plan."]
    for t in TECHNIQUES:
        won = [r for r in fitted if r["technique"] == t]
        if t == "dp x tp" or not won:
            out.append(f"- {t} wins {len(won)} cells.")
            continue
        alone = [r for r in won if "dp x tp" not in r["best"]]
        if alone:
            out.append(f"- {t} wins {len(alone)} cells where no plain plan serves a sequence.")
        won = [r for r in won if "dp x tp" in r["best"]]
        if not won:
            continue
        margins = sorted(
            r["tokens_per_s_per_device"] / r["best"]["dp x tp"]["tokens_per_s_per_device"] - 1 for r in won
        )
        clear = sum(m > 0.01 for m in margins)
        out.append(
            f"- {t} wins {len(won)} cells, {clear} of them by more than 1% over the best plain plan (margins "
            f"{margins[0]:+.1%} to {margins[-1]:+.1%}, median {margins[len(margins) // 2]:+.1%})."
        )
    both = [r for r in fitted if "layer sharding" in r["best"] and "module TP" in r["best"]]
    ratio = [
        r["best"]["layer sharding"]["tokens_per_s_per_device"] / r["best"]["module TP"]["tokens_per_s_per_device"] - 1
        for r in both
    ]
    out.append(
        f"- Where both fit ({len(both)} cells), the best layer-sharded plan beats the best module-TP plan in "
        f"{sum(x > 0 for x in ratio)}, by more than 1% in {sum(x > 0.01 for x in ratio)} (largest "
        f"{max(ratio):+.1%}); module TP beats it by more than 1% in {sum(x < -0.01 for x in ratio)}."
    )
    for t in NOT_RUN:
        ahead = sorted(
            r["best"][t]["tokens_per_s_per_device"] / r["tokens_per_s_per_device"] - 1
            for r in fitted
            if t in r["best"] and r["best"][t]["tokens_per_s_per_device"] > r["tokens_per_s_per_device"]
        )
        priced = sum(t in r["best"] for r in fitted)
        out.append(
            f"- {t} (priced, not run by this library) fits in {priced} cells and models better than the chosen plan "
            f"in {len(ahead)}"
            + (f" (by {ahead[0]:+.1%} to {ahead[-1]:+.1%}, median {ahead[len(ahead) // 2]:+.1%})." if ahead else ".")
        )
    refused = sum(r["layer_shard_refused"] for r in fitted)
    out.append(
        f"- {refused} layer-sharded candidates over all cells were refused for saving no memory (owned layers "
        f"plus ring at least the replicated weights)."
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks planner_map", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", metavar="FILE", help="also write the table and its summary here")
    parser.add_argument("--json", metavar="FILE", help="also write every cell here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = cells()
    text = summary(rows) + "\n\n" + markdown(rows)
    if args.markdown:
        head = (__doc__ or "").split("\n\n", 2)
        text_doc = f"# Where each technique pays (generated)\n\n{head[0]}\n\n{head[2].strip()}\n\n"
        text_doc += "Reproduce: `python -m benchmarks planner_map --markdown docs/planner_map.md`.\n\n" + text
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text_doc + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0
