"""Hostile inputs to the planner and the placement it checks plans with: each refused once, up front, in one line
naming the parameter and the value; an unbounded memory budget (``math.inf``, ``estimate``'s own default) answers as
a budget past every need does."""

import dataclasses
import re

import pytest
import torch

from functional_npu import Plan, Quant
from functional_npu.placement import QuantConfig, place, ring_memory
from functional_npu.placement.check import resolved
from functional_npu.placement.ring_memory import _count, _largest_saving_step
from functional_npu.runtime.planning import (
    MAX_MEMORY,
    Workload,
    candidates,
    choose_plan,
    disaggregated_estimate,
    estimate,
    gb_at_least,
    serve_estimate,
    simplest,
    techniques,
)

from ..support.configs import DENSE

NAN, INF = float("nan"), float("inf")
CAND = candidates(DENSE, 1)[0]
DECODE, SERVE = Workload.decode(1, 32), Workload.serve(32)
PLACED = place(DENSE, {"dp": 2, "tp": 1}, Plan(layer_shard="layer", prefetch_step=1))
MEMORY = "must be a positive number of bytes (math.inf: unbounded), got"

REFUSED = [
    # ring_memory: the step bounded as place() bounds prefetch_step (an unbounded one once hung)
    (
        lambda: ring_memory(PLACED, step=10**7),
        ValueError,
        "ring_memory: step 10000000 is past the model's 4 layers: a ring of k + 1 slots holds at most all of them, so "
        "k <= num_layers - 1 = 3 (place() refuses the same prefetch_step); give 0 <= step <= 3",
    ),
    (
        lambda: ring_memory(None),
        TypeError,
        "ring_memory: placed must be a Placement (functional_npu.placement.place(cfg, mesh, plan)), got NoneType",
    ),
    # QuantConfig and place's quant, mesh and cfg
    (
        lambda: QuantConfig(Quant(), "naive-quantized", "Linear", ()),
        TypeError,
        "QuantConfig: targets must be a tuple of module names or classes (a str is read letter by letter), got "
        "'Linear'; give ('Linear',)",
    ),
    (
        lambda: QuantConfig(Quant(), "naive-quantized", ("Linear",), "lm_head"),
        TypeError,
        "QuantConfig: ignore must be a tuple of module names or classes (a str is read letter by letter), got "
        "'lm_head'; give ('lm_head',)",
    ),
    (
        lambda: QuantConfig(Quant(), "int4-magic", ("Linear",), ()),
        ValueError,
        "QuantConfig: format must be one of ['int-quantized', 'naive-quantized', 'pack-quantized'], got 'int4-magic'",
    ),
    (
        lambda: QuantConfig.of("int8"),
        TypeError,
        "QuantConfig.of: quant must be a Quant (e.g. Quant(8) or Quant(4, 'group', 128)), got 'int8'",
    ),
    (
        lambda: place(DENSE, {"tp": 1}, None, "int8"),
        TypeError,
        "model: quant must be a QuantConfig (e.g. QuantConfig.of(Quant(8)), or read_quant_config of a checkpoint's "
        "config.json) or None, got 'int8'",
    ),
    (
        lambda: place(DENSE, None),
        TypeError,
        "model: mesh must be a functional_npu.Mesh or a dict of axis sizes such as {'dp': 2, 'tp': 1}, got NoneType",
    ),
    (
        lambda: place({"vocab_size": 64}, {"tp": 1}),
        TypeError,
        "model: cfg: dict is not a model config; expected one of",
    ),
    (
        lambda: place("LlamaForCausalLM", {"tp": 1}),
        TypeError,
        "model: cfg must be a model config (functional_npu.read_config(path)), got 'LlamaForCausalLM'",
    ),
    (lambda: resolved(DENSE, None), TypeError, "resolved: plan must be a functional_npu.Plan, got NoneType"),
    # Workload: fields another kind reads, a bool cache
    (
        lambda: Workload("decode", 1, context=8, length=-5),
        ValueError,
        "workload: length=-5 does not apply to a decode workload (it reads batch, context); drop it, or build the "
        "workload with Workload.decode(...)",
    ),
    (
        lambda: Workload("decode", 1, context=8, prompt_share=0.5),
        ValueError,
        "workload: prompt_share=0.5 does not apply to a decode workload (it reads batch, context)",
    ),
    (
        lambda: Workload("decode", 1, context=8, max_seqs=4),
        ValueError,
        "workload: max_seqs=4 does not apply to a decode workload (it reads batch, context)",
    ),
    (
        lambda: Workload("prefill", 1, length=8, context=8),
        ValueError,
        "workload: context=8 does not apply to a prefill workload (it reads batch, length); drop it, or build the "
        "workload with Workload.prefill(...)",
    ),
    (
        lambda: Workload("serve", 4, context=8),
        ValueError,
        "workload: batch=4 does not apply to a serve workload (it reads context, prompt_share, max_seqs)",
    ),
    (
        lambda: Workload("decode", 1, context=32, kv_dtype=torch.bool),
        ValueError,
        "workload: kv_dtype must be a torch dtype of 1, 2 or 4 bytes, a floating one (torch.bfloat16, "
        "torch.float8_e4m3fn), got torch.bool",
    ),
    # the memory budget: NaN and negatives refused as choose_plan refuses them
    (
        lambda: estimate(DENSE, CAND, "h100", DECODE, memory_per_device=NAN),
        ValueError,
        f"estimate: memory_per_device {MEMORY} nan",
    ),
    (
        lambda: estimate(DENSE, CAND, "h100", DECODE, memory_per_device=-5),
        ValueError,
        f"estimate: memory_per_device {MEMORY} -5",
    ),
    (
        lambda: serve_estimate(DENSE, CAND, "h100", SERVE, memory_per_device=-5),
        ValueError,
        f"serve_estimate: memory_per_device {MEMORY} -5",
    ),
    (
        lambda: serve_estimate(DENSE, CAND, "h100", SERVE, memory_per_device=NAN),
        ValueError,
        f"serve_estimate: memory_per_device {MEMORY} nan",
    ),
    (
        lambda: serve_estimate(DENSE, CAND, "h100", SERVE, memory_per_device=INF),
        ValueError,
        "serve_estimate: memory_per_device=inf (unbounded) admits any number of sequences and the workload has no "
        "cap; give it one (Workload.serve(context, max_seqs=n)) or a finite memory budget in bytes",
    ),
    (
        lambda: disaggregated_estimate(DENSE, CAND, CAND, "h100", Workload.serve(32, 0.5), memory_per_device=NAN),
        ValueError,
        f"disaggregated_estimate: memory_per_device {MEMORY} nan",
    ),
    (
        lambda: estimate(DENSE, {"name": "x"}, "h100", DECODE),
        TypeError,
        "estimate: candidate must be a Candidate (planning.candidates(cfg, devices) lists them), got {'name': 'x'}",
    ),
    (
        lambda: estimate(DENSE, CAND, "h100", DECODE, dispatch="bogus"),
        ValueError,
        "estimate: dispatch must be one of ('runtime', 'routed'), got 'bogus'",
    ),
    # choose_plan: one bad argument refused once, not once per candidate
    (
        lambda: choose_plan(DENSE, 1, "h100", 80e9, DECODE, dispatch="bogus"),
        ValueError,
        "choose_plan: dispatch must be one of ('runtime', 'routed'), got 'bogus'",
    ),
    (
        lambda: choose_plan(DENSE, 1, "h100", 80e9, DECODE, quant="int8"),
        TypeError,
        "choose_plan: quant must be a QuantConfig (e.g. QuantConfig.of(Quant(8))) or None, got 'int8'",
    ),
    # simplest, gb_at_least, techniques
    (
        lambda: simplest([], DECODE, 0.1),
        ValueError,
        "simplest: none of the 0 ranked plans fits; it chooses among fitting ones (choose_plan raises PlanDoesNotFit "
        "with the memory that would fit instead)",
    ),
    (lambda: gb_at_least(INF), ValueError, "gb_at_least: n must be a finite number of bytes >= 0, got inf"),
    (lambda: gb_at_least(NAN), ValueError, "gb_at_least: n must be a finite number of bytes >= 0, got nan"),
    (lambda: gb_at_least(-5), ValueError, "gb_at_least: n must be a finite number of bytes >= 0, got -5"),
    (lambda: techniques(None), TypeError, "techniques: plan must be a functional_npu.Plan, got NoneType"),
]


@pytest.mark.parametrize("call, error, message", REFUSED, ids=[m[:60] for _, _, m in REFUSED])
def test_refused_in_one_line(call, error, message):
    with pytest.raises(error, match=re.escape(message)) as e:
        call()
    assert "\n" not in str(e.value)


def test_choose_plan_names_a_bad_dispatch_once():
    with pytest.raises(ValueError) as e:
        choose_plan(DENSE, 2, "h100", 80e9, DECODE, dispatch="bogus")
    assert str(e.value).count("dispatch") == 1 and "candidate" not in str(e.value)


def test_an_unbounded_budget_is_a_budget_past_every_need():
    """``math.inf`` (``estimate``'s default) serves a capped workload as the largest budget the planner takes does."""
    capped = Workload.serve(32, 0.25, max_seqs=4)
    unbounded = serve_estimate(DENSE, CAND, "h100", capped, memory_per_device=INF)
    huge = serve_estimate(DENSE, CAND, "h100", capped, memory_per_device=MAX_MEMORY)
    figures = ("batch", "tokens_per_s", "per_device", "bytes", "fits", "bottleneck")
    assert [getattr(unbounded, f) for f in figures] == [getattr(huge, f) for f in figures]
    assert unbounded.batch == 4 and unbounded.fits
    assert estimate(DENSE, CAND, "h100", DECODE, memory_per_device=INF).fits


def test_disaggregated_with_an_unbounded_budget():
    work = Workload.serve(32, 0.25, max_seqs=4)
    a = disaggregated_estimate(DENSE, CAND, CAND, "h100", work, memory_per_device=INF)
    b = disaggregated_estimate(DENSE, CAND, CAND, "h100", work, memory_per_device=MAX_MEMORY)
    assert (a.batch, a.tokens_per_s, a.bytes, a.fits) == (b.batch, b.tokens_per_s, b.bytes, b.fits)


@pytest.mark.parametrize("n", [2, 4])
def test_the_smaller_step_found_by_bisection_is_the_scans(n):
    """The bisection over smaller steps finds what a scan from ``k - 1`` down finds (whether a ring saves is
    monotone in its step), in ``log k`` counts."""
    cfg = dataclasses.replace(DENSE, num_layers=8)
    placed = place(cfg, {"dp": n, "tp": 1}, Plan(layer_shard="layer", prefetch_step=1))
    ls, axes = placed.plan.layer_shard, placed.mesh_shape
    for k in range(cfg.num_layers):
        scan = next((s for s in range(k - 1, -1, -1) if _count(placed, s, ls, axes).saves), None)
        found = _largest_saving_step(placed, k, ls)
        assert (found.step if found is not None else None) == scan
