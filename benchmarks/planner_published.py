"""The step model against published serving figures: each deployment's setting reproduced through the planner's own
API, a fixed cost per step fitted per device profile on some of them, the rest held out.

    python -m benchmarks planner_published [--json benchmarks/results/planner_published.json] [--markdown FILE]

Every deployment is a published measurement (vllm-ascend's tutorials, its nightly benchmark baselines and issues;
LMSYS's large-scale EP posts), listed in :data:`DEPLOYMENTS` with its source and the figure as printed. Each is
priced with :func:`~functional_npu.runtime.planning.estimate` on the device's profile with its fixed cost set to 0
(the roofline, the collectives as the runtime issues them):

- a decode figure (TPOT, or a decode pool's tokens/s at a stated batch): one decode step of the running batch at the
  sequences' mean context (prompt plus half the output);
- an end-to-end figure (output tokens/s of a benchmark whose prompts and generations share the devices): ``batch``
  requests finish ``out`` tokens each in ``out`` decode steps plus ``batch / dp`` prefills of one prompt per dp rank,
  so ``tokens/s = batch x out / (out x (decode + c) + batch / dp x (prefill + c))``.

The fixed cost ``c`` of each fitting row solves that equation for its published figure; a profile's fitted cost is
the median over its fitting rows, and its spread the largest relative error of a fitting row predicted from the
others' cost (leave one out; none from a single row). The held-out
rows are then predicted with the fitted cost (the H200 with the H100's: no H200 row was fitted) and compared with
what was published. Nothing here reads a checkpoint or runs a model: configs are the published ``config.json``
sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from functional_npu.core import Quant
from functional_npu.models import family_of
from functional_npu.parallel import Plan, device
from functional_npu.placement import QuantConfig
from functional_npu.runtime.planning import Candidate, PlanDoesNotFit, Workload, choose_plan, estimate

from .planner_map import QWEN3_30B_A3B
from .planner_paper import MODELS, W8A8, _deepseek_v3

W4 = QuantConfig.of(Quant(4, "group", group_size=32))  # int4 weights, 16-bit activations (Kimi K2's experts: QAT int4)

QWEN3_235B = QWEN3_30B_A3B | {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
}


def _kimi_k2() -> dict:
    """Kimi K2's published sizes: DeepSeek-V3's architecture with 384 experts and 64 heads."""
    return _deepseek_v3() | {
        "vocab_size": 163840,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_routed_experts": 384,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
    }


def configs() -> dict[str, Any]:
    hf = {
        "Qwen3-32B": MODELS["Qwen3-32B"],
        "Qwen3-30B-A3B": QWEN3_30B_A3B,
        "Qwen3-235B-A22B": QWEN3_235B,
        "DeepSeek-R1": _deepseek_v3(),
        "Kimi-K2": _kimi_k2(),
    }
    return {name: family_of(h["architectures"][0]).from_hf(h) for name, h in hf.items()}


@dataclass(frozen=True)
class Deployment:
    """One published measurement. ``figure``: the published number, ``unit``: ``"tpot_ms"`` (a decode step),
    ``"tok_s"`` (output tokens/s of the whole deployment, end to end) or ``"decode_tok_s"`` (output tokens/s of a
    decode pool at ``batch`` running sequences). ``batch``: sequences running at once on the whole deployment."""

    name: str
    model: str
    device: str
    axes: dict[str, int]
    ep: bool
    quant: str | None
    batch: int
    prompt: int
    output: int
    figure: float
    unit: str
    role: str  # "fit" or "held out"
    source: str
    note: str = ""
    slots: int = 0  # expert slots over the EP group (EPLB's redundant copies; 0: one per expert)
    schedule: str = "serial"  # "two_batch": the deployment overlaps two micro-batches (SGLang's TBO)

    @property
    def devices(self) -> int:
        return self.axes["dp"] * self.axes["tp"]


_TUTORIAL = "github.com/vllm-project/vllm-ascend/blob/182b75ea/docs/source/tutorials/"
_NIGHTLY = "github.com/vllm-project/vllm-ascend/blob/182b75ea/tests/e2e/nightly/"
DEPLOYMENTS = (
    Deployment(
        "Qwen3-32B bf16, 4 x 910B TP4, concurrency 1", "Qwen3-32B", "ascend-910b", {"dp": 1, "tp": 4}, False, None,
        1, 150, 2700, 55.1, "tpot_ms", "fit", _TUTORIAL + "features/suffix_speculative_decoding.md (Base TPOT)",
    ),
    Deployment(
        "Qwen3-32B W8A8, 4 x 910B TP4, batch 72", "Qwen3-32B", "ascend-910b", {"dp": 1, "tp": 4}, False, "w8a8",
        72, 3500, 1500, 1065.179, "tok_s", "fit", _NIGHTLY + "single_node/models/configs/Qwen3-32B-Int8-A2.yaml",
        "a nightly baseline (pass at 0.97 of it)",
    ),
    Deployment(
        "Qwen3-32B bf16, 4 x 910B TP4, concurrency 26", "Qwen3-32B", "ascend-910b", {"dp": 1, "tp": 4}, False, None,
        26, 150, 2700, 64.7, "tpot_ms", "held out", _TUTORIAL + "features/suffix_speculative_decoding.md (Base TPOT)",
    ),
    Deployment(
        "DeepSeek-R1 W8A8 decode, 32 x 910B DP32 EP32, concurrency 8", "DeepSeek-R1", "ascend-910b",
        {"dp": 32, "tp": 1}, True, "w8a8", 8, 7000, 2000, 42.2, "tpot_ms", "held out",
        "github.com/vllm-project/vllm-ascend/issues/4295 (vllm-ascend's decode pool; a user's report)",
        "prefill on other devices: the decode pool's TPOT",
    ),
    Deployment(
        "Qwen3-32B W8A8, 4 x 910C dies TP4, batch 72", "Qwen3-32B", "ascend-910c", {"dp": 1, "tp": 4}, False, "w8a8",
        72, 3500, 1500, 1300.0, "tok_s", "fit", _TUTORIAL + "multi_npu_qwen_dense.md (650 TPS per card, 2 cards)",
    ),
    Deployment(
        "Qwen3-30B-A3B W8A8, 1 x 910C die, batch 45", "Qwen3-30B-A3B", "ascend-910c", {"dp": 1, "tp": 1}, False,
        "w8a8", 45, 3500, 1500, 812.3394, "tok_s", "fit",
        _NIGHTLY + "single_node/models/configs/Qwen3-30B-A3B-W8A8.yaml", "a nightly baseline",
    ),
    Deployment(
        "Qwen3-32B W8A8, 4 x 910C dies TP4, batch 76", "Qwen3-32B", "ascend-910c", {"dp": 1, "tp": 4}, False, "w8a8",
        76, 3500, 1500, 1249.018, "tok_s", "held out", _NIGHTLY + "single_node/models/configs/Qwen3-32B-Int8.yaml",
        "a nightly baseline",
    ),
    Deployment(
        "Qwen3-32B W8A8, 4 x 910C dies TP4, batch 76, async scheduling", "Qwen3-32B", "ascend-910c",
        {"dp": 1, "tp": 4}, False, "w8a8", 76, 3500, 1500, 1326.599, "tok_s", "held out",
        _NIGHTLY + "single_node/models/configs/Qwen3_32b_w8a8_ml_A3.yaml", "a nightly baseline",
    ),
    Deployment(
        "Qwen3-235B-A22B bf16, 32 x 910C dies DP4 TP8 EP, 128 running", "Qwen3-235B-A22B", "ascend-910c",
        {"dp": 4, "tp": 8}, True, None, 128, 3500, 1500, 2209.9211, "tok_s", "held out",
        _NIGHTLY + "multi_node/internal_dp/config/Qwen3-235B-A22B.yaml",
        "a nightly baseline; 4 dp ranks x max-num-seqs 32 running",
    ),
    Deployment(
        "Kimi K2 (int4 experts), 16 x 910C dies TP16 EP, concurrency 1", "Kimi-K2", "ascend-910c",
        {"dp": 1, "tp": 16}, True, "w4", 1, 1024, 1024, 57.71, "tpot_ms", "held out",
        _TUTORIAL + "models/Kimi-K2-Thinking.md", "int4 everywhere here (the release quantizes its experts)",
    ),
    Deployment(
        "Kimi K2 (int4 experts), 16 x 910C dies TP16 EP, concurrency 8", "Kimi-K2", "ascend-910c",
        {"dp": 1, "tp": 16}, True, "w4", 8, 1024, 1024, 87.37, "tpot_ms", "held out",
        _TUTORIAL + "models/Kimi-K2-Thinking.md",
    ),
    Deployment(
        "DeepSeek-V3 decode, 72 x H100 DP72 EP72, batch 256 per GPU", "DeepSeek-R1", "h100-sxm",
        {"dp": 72, "tp": 1}, True, "w8a8", 72 * 256, 2000, 0, 22282 / 8, "decode_tok_s", "fit",
        "lmsys.org/blog/2025-05-05-large-scale-ep (22,282 tok/s per node of 8)",
        "FP8 weights priced as 8-bit (int8 W8A8: the same bytes); KV length 2000; 32 redundant experts (EPLB); "
        "two-batch overlap",
        288, "two_batch",
    ),
    Deployment(
        "Kimi K2 decode, 96 x H200 DP96 EP96, batch 480 per GPU", "Kimi-K2", "h200-sxm",
        {"dp": 96, "tp": 1}, True, "w8a8", 96 * 480, 2000, 100, 24000 / 8, "decode_tok_s", "held out",
        "lmsys.org/blog/2025-07-17-k2-large-scale-ep (384k tok/s over 12 decode nodes: 24k per node of 8)",
        "FP8 weights priced as 8-bit; 96 redundant experts (EPLB); two-batch overlap; the H100's fitted fixed cost "
        "(no H200 row)",
        480, "two_batch",
    ),
)  # fmt: skip
QUANTS = {None: None, "w8a8": W8A8, "w4": W4}


def _modelled(d: Deployment, cfg: Any, overhead: float) -> dict[str, float]:
    """The deployment's modelled decode and prefill steps (``overhead`` added to each) and its figure."""
    dev = dataclasses.replace(device(d.device), step_overhead_s=overhead)
    plan = Plan(expert_axes=("dp", "tp") if d.ep else (), num_slots=d.slots or None, max_copies=2 if d.slots else 1)
    cand = Candidate(d.name, dict(d.axes), plan, schedule=d.schedule)
    quant = QUANTS[d.quant]
    context = d.prompt + d.output // 2
    how = {"quant": quant, "dispatch": "routed"}  # the deployments dispatch each token to its experts' ranks
    decode = estimate(cfg, cand, dev, Workload.decode(d.batch, context, torch.bfloat16), **how).step_s
    out = {"decode_ms": decode * 1e3}
    if d.unit == "tpot_ms":
        out["figure"] = decode * 1e3
    elif d.unit == "decode_tok_s":
        out["figure"] = d.batch / decode / d.devices
    else:
        dp = d.axes["dp"]
        prefill = estimate(cfg, cand, dev, Workload.prefill(d.prompt, dp, torch.bfloat16), **how).step_s
        out["prefill_ms"] = prefill * 1e3
        out["figure"] = d.batch * d.output / (d.output * decode + d.batch / dp * prefill)
    return out


def deployed_name(d: Deployment) -> str:
    """The deployment's plan as the planner names its candidates."""
    dp, tp = d.axes["dp"], d.axes["tp"]
    return f"dp {dp} x tp {tp}" + (f", EP {d.devices}" if d.ep else "")


def chosen(d: Deployment, cfg: Any) -> dict[str, Any]:
    """The planner's choice for the deployment's devices, memory and running batch (decode at its mean context),
    priced as the deployment dispatches; beside the deployed plan, and the deployed plan's modelled step against the
    choice's. Deployments with redundant experts (not in the planner's search) are skipped."""
    dev = device(d.device)
    work = Workload.decode(d.batch, d.prompt + d.output // 2, torch.bfloat16)
    try:
        placement, report = choose_plan(
            cfg, d.devices, dev, dev.memory_bytes, work, quant=QUANTS[d.quant], dispatch="routed"
        )
    except PlanDoesNotFit as e:
        return {"chosen": None, "why": str(e)}
    mine = report.chosen
    name = deployed_name(d) + (", two-batch overlap" if d.schedule == "two_batch" else "")
    theirs = next((e for e in report.ranked if e.candidate.name == name), None)
    return {
        "chosen": mine.candidate.name,
        "deployed": name,
        "same": mine.candidate.name == deployed_name(d),  # the shape: this library runs no two-batch overlap
        "chosen_step_ms": mine.step_s * 1e3,
        "deployed_step_ms": None if theirs is None else theirs.step_s * 1e3,
        "deployed_fits": None if theirs is None else theirs.fits,
        "rule": report.rule,
    }


def _fixed_cost(d: Deployment, cfg: Any) -> float:
    """The fixed cost per step (s) that makes the deployment's modelled figure its published one."""
    bare = _modelled(d, cfg, 0.0)
    if d.unit == "tpot_ms":
        return (d.figure - bare["decode_ms"]) / 1e3
    if d.unit == "decode_tok_s":
        return d.batch / (d.figure * d.devices) - bare["decode_ms"] / 1e3
    dp = d.axes["dp"]
    total = d.batch * d.output / d.figure
    steps = d.output + d.batch / dp
    return (total - d.output * bare["decode_ms"] / 1e3 - d.batch / dp * bare["prefill_ms"] / 1e3) / steps


def _higher_is_better(d: Deployment) -> bool:
    return d.unit != "tpot_ms"


def run(plans: bool = True) -> dict[str, Any]:
    """The fit per profile and every row's figures: bare (roofline and collectives), with the fitted cost,
    published; with ``plans``, the planner's choice for each deployment beside the deployed plan (:func:`chosen`)."""
    cfgs = configs()
    fits: dict[str, list[float]] = {}
    for d in DEPLOYMENTS:
        if d.role == "fit":
            fits.setdefault(d.device, []).append(_fixed_cost(d, cfgs[d.model]))
    fitted = {dev: statistics.median(costs) for dev, costs in fits.items()}
    fitted.setdefault("h200-sxm", fitted.get("h100-sxm", 0.0))  # no H200 row fitted: the H100's
    rows = []
    for d in DEPLOYMENTS:
        cfg = cfgs[d.model]
        bare = _modelled(d, cfg, 0.0)
        with_cost = _modelled(d, cfg, fitted[d.device])
        # the error as published / predicted in the direction of "higher is better" (a TPOT is inverted)
        ratio = with_cost["figure"] / d.figure if _higher_is_better(d) else d.figure / with_cost["figure"]
        bare_ratio = bare["figure"] / d.figure if _higher_is_better(d) else d.figure / bare["figure"]
        rows.append(
            {
                "name": d.name,
                "role": d.role,
                "device": d.device,
                "devices": d.devices,
                "unit": d.unit,
                "published": d.figure,
                "bare": bare["figure"],
                "predicted": with_cost["figure"],
                "predicted_over_published": ratio,
                "bare_over_published": bare_ratio,
                "own_fixed_cost_ms": _fixed_cost(d, cfg) * 1e3,
                "source": d.source,
                "note": d.note,
                "plan": chosen(d, cfg) if plans else None,
            }
        )
    spread = {}  # leave one out: each fitting row predicted from the others' median cost
    for dev, costs in fits.items():
        if len(costs) < 2:
            continue  # one fitting row: no spread to measure
        mine = [d for d in DEPLOYMENTS if d.device == dev and d.role == "fit"]
        errs = []
        for i, d in enumerate(mine):
            rest = statistics.median(c for j, c in enumerate(costs) if j != i)
            got = _modelled(d, cfgs[d.model], rest)["figure"]
            errs.append(abs((got / d.figure if _higher_is_better(d) else d.figure / got) - 1))
        spread[dev] = max(errs)
    held = [r for r in rows if r["role"] == "held out"]
    errors = [abs(r["predicted_over_published"] - 1) for r in held]
    return {
        "fixed_cost_ms": {dev: c * 1e3 for dev, c in fitted.items()},
        "fit_costs_ms": {dev: [c * 1e3 for c in costs] for dev, costs in fits.items()},
        "spread": spread,
        "held_out": {
            "rows": len(held),
            "median_error": statistics.median(errors),
            "worst_ratio": max(max(r["predicted_over_published"], 1 / r["predicted_over_published"]) for r in held),
            "median_error_bare": statistics.median(abs(r["bare_over_published"] - 1) for r in held),
        },
        "rows": rows,
    }


def _fmt(x: float, unit: str) -> str:
    return f"{x:.1f} ms" if unit == "tpot_ms" else f"{x:.0f} tok/s"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| deployment | role | published | roofline only | with fixed cost | predicted / published |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        u = r["unit"]
        per = " per device" if u == "decode_tok_s" else ""
        lines.append(
            f"| {r['name']} | {r['role']} | {_fmt(r['published'], u)}{per} | {_fmt(r['bare'], u)} | "
            f"{_fmt(r['predicted'], u)} | {r['predicted_over_published']:.2f} |"
        )
    lines += ["", "| deployment | deployed | chosen | step ms: chosen / deployed | rule |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        c = r["plan"]
        if c is None:
            continue
        if c["chosen"] is None:
            lines.append(f"| {r['name']} | | none | | {c['why'][:100]} |")
            continue
        step = f"{c['chosen_step_ms']:.1f} / " + (f"{c['deployed_step_ms']:.1f}" if c["deployed_step_ms"] else "n/a")
        lines.append(f"| {r['name']} | {c['deployed']} | {c['chosen']} | {step} | {c['rule']} |")
    h = result["held_out"]
    lines += [
        "",
        "Fixed cost per step (median of the fitting rows' own): "
        + ", ".join(f"{dev} {c:.1f} ms" for dev, c in result["fixed_cost_ms"].items())
        + "; spread (leave one out): "
        + ", ".join(f"{dev} {s:.0%}" for dev, s in result["spread"].items()),
        f"Held out ({h['rows']} rows): median error {h['median_error']:.0%} (roofline only: "
        f"{h['median_error_bare']:.0%}), worst {h['worst_ratio']:.2f}x.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks planner_published", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="write the fit and every row here")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = run()
    table = markdown(result)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0
