"""The planner's serving objective: the batch a budget admits (KV cache counted by an independent formula), the
choice's properties (it fits, more memory never serves fewer tokens/s, a layer-sharded plan it ranks always holds
less than the same split replicated, a refusal's figure is accepted given back), groups priced by the nodes they
span, FLOPs from logical weights, and bad input in one line."""

import dataclasses
import math
from decimal import Decimal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from functional_npu.core import Quant
from functional_npu.parallel import Device, Link, device
from functional_npu.placement import QuantConfig
from functional_npu.runtime.planning import (
    PlanDoesNotFit,
    Workload,
    candidates,
    choose_plan,
    estimate,
    serve_estimate,
)

from ..support.configs import DENSE, MLA, MOE

F32 = torch.float32
DEEP = dataclasses.replace(DENSE, num_layers=8)  # 8 layers over dp 2: 4 owned + a ring of 2 saves memory


def _kv_per_seq(cfg, tp: int, context: int, e: int) -> int:
    """K and V of one sequence on one rank, from the config alone: GQA heads split over tp (replicated when
    fewer than tp), every layer, every position."""
    heads = max(1, cfg.num_kv_heads // tp)
    return 2 * cfg.num_layers * heads * cfg.head_dim * context * e


def test_the_served_batch_is_the_most_the_budget_admits():
    """Every candidate of 4 devices at a 3 MB budget: its bytes fit, its KV cache is its sequences' K and V by the
    formula (in blocks of 16 positions, and the pool's null block), and one more sequence per data-parallel rank
    would not fit."""
    work, memory = Workload.serve(64, 0.25, dtype=F32), 3e6
    seen = 0
    for c in candidates(DEEP, 4):
        s = serve_estimate(DEEP, c, "910b", work, memory_per_device=memory)
        tp = c.axes["tp"]
        dp = c.devices // tp
        assert s.fits and s.batch >= dp and s.batch % dp == 0 and s.bytes["total"] <= memory, c.name
        null = _kv_per_seq(DEEP, tp, 16, 4)  # the pool's null block (16 positions)
        assert s.bytes["kv_cache"] == s.batch // dp * _kv_per_seq(DEEP, tp, 64, 4) + null, c.name
        more = estimate(DEEP, c, "910b", Workload.decode(s.batch + dp, 63, F32)).bytes
        acts = max(more["activations"], s.bytes["activations"])  # the larger of its decode's and the prefill's
        assert more["total"] - more["activations"] + acts > memory, c.name
        assert s.tokens_per_s > 0 and s.per_device == pytest.approx(s.tokens_per_s / c.devices)
        seen += 1
    assert seen == len(candidates(DEEP, 4))


def test_a_cap_on_sequences_and_a_prompt_mix_are_served():
    c = next(c for c in candidates(DEEP, 2) if c.name == "dp 2 x tp 1")
    free = serve_estimate(DEEP, c, "910b", Workload.serve(64, dtype=F32), memory_per_device=3e6)
    capped = serve_estimate(DEEP, c, "910b", Workload.serve(64, max_seqs=3, dtype=F32), memory_per_device=3e6)
    assert free.batch > 3 and capped.batch == 3 and capped.tokens_per_s < free.tokens_per_s
    mixed = serve_estimate(DEEP, c, "910b", Workload.serve(64, 0.5, dtype=F32), memory_per_device=3e6)
    assert mixed.prefill is not None and mixed.prefill.bytes["activations"] > 0
    decode_only = 1 / (free.decode.step_s / free.batch)
    assert free.tokens_per_s == pytest.approx(decode_only)  # decode alone: the batch over the step


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    low=st.floats(0.2, 4.0),
    extra=st.floats(0.0, 4.0),
    share=st.sampled_from([0.0, 0.25, 0.5]),
    cfg=st.sampled_from([DEEP, MOE, MLA]),
)
def test_served_choice_fits_more_memory_never_serves_less_and_sharding_always_saves(low, extra, share, cfg):
    """Budgets in MB around the tiny models' needs: the chosen plan fits with at least one sequence, a larger
    budget's choice never serves fewer tokens/s per device, every layer-sharded plan ranked holds less weight and
    ring than its split replicated, and a refusal's figure, given back exactly, is accepted."""
    work = Workload.serve(48, share, dtype=F32)
    served = {}
    for mb in (low, low + extra):
        try:
            _, report = choose_plan(cfg, 4, "910b", mb * 1e6, work)
        except PlanDoesNotFit as e:
            number, unit = e.figure.split(" ")
            given_back = int(Decimal(number) * {"GB": 10**9, "MB": 10**6, "kB": 10**3, "B": 1}[unit])
            _, again = choose_plan(cfg, 4, "910b", given_back, work)
            assert again.chosen.batch >= 1 and again.chosen.bytes["total"] <= given_back
            served[mb] = 0.0
            continue
        best = report.chosen
        assert best.fits and best.batch >= 1 and best.bytes["total"] <= mb * 1e6
        replicated = {tuple(e.candidate.axes.items()): e.bytes["weights"] for e in report.ranked if not _ls(e)}
        for e in report.ranked:
            if _ls(e) and tuple(e.candidate.axes.items()) in replicated:
                assert e.bytes["weights"] + e.bytes["prefetch"] < replicated[tuple(e.candidate.axes.items())]
        served[mb] = best.per_device
    assert served[low + extra] >= served[low] * (1 - 1e-12)


def _ls(e) -> bool:
    return e.candidate.plan.layer_shard is not None and not e.candidate.plan.module_tp


def test_layer_sharding_that_saves_no_memory_is_never_ranked():
    """4 layers over dp 2 hold 2 owned layers and a ring of at least 2 slots: as much as replication, so every
    layer-sharded candidate is refused with both figures; 8 layers save, and are ranked."""
    _, report = choose_plan(DENSE, 2, "910b", 1e9, Workload.serve(32, dtype=F32))
    refused = dict(report.refused)
    sharded = [c.name for c in candidates(DENSE, 2) if c.plan.layer_shard is not None]
    assert sharded and all(name in refused for name in sharded)
    assert all("saves no memory" in refused[n] and "% of the" in refused[n] for n in sharded)
    assert not any(e.candidate.plan.layer_shard for e in report.ranked)
    _, deep = choose_plan(DEEP, 2, "910b", 1e9, Workload.serve(32, dtype=F32))
    assert any(e.candidate.plan.layer_shard for e in deep.ranked)


def test_groups_are_priced_on_the_links_they_span():
    """16 x 910B: dp 2 x tp 8 puts each dp group {r, r + 8} on two nodes, so its layer-shard broadcasts run on the
    200GE port, not HCCS; the tp 8 groups stay on one node in both."""
    dev = device("910b")
    one_node = dataclasses.replace(dev, node_size=16)
    assert dev.nodes_spanned([0, 8]) == 2 and dev.nodes_spanned(range(8)) == 1 and one_node.nodes_spanned([0, 8]) == 1
    wide = dataclasses.replace(DEEP, num_heads=8, num_kv_heads=8)  # heads that tp 8 can split
    c = next(c for c in candidates(wide, 16) if c.name == "dp 2 x tp 8, layer layer-sharded over dp")
    work = Workload.decode(16, 64)
    split, joined = (estimate(wide, c, d, work) for d in (dev, one_node))
    assert split.parts["all_reduce"] == joined.parts["all_reduce"]
    assert split.parts["prefetch_exposed_s"] > joined.parts["prefetch_exposed_s"]
    plain = next(c for c in candidates(wide, 16) if c.name == "dp 16 x tp 1, mlp TP 16")
    a, b = (estimate(wide, plain, d, work) for d in (dev, one_node))
    assert a.parts["all_gather"] > b.parts["all_gather"]  # a group of 16 spans both nodes


def test_flops_count_logical_weights_under_weight_only_quantization():
    """W4A16 multiplies as many bf16 weights as the float model: the same compute, fewer bytes read."""
    w4 = QuantConfig.of(Quant(4, "group", group_size=16))
    c = next(c for c in candidates(DENSE, 2) if c.name == "dp 1 x tp 2")
    work = Workload.prefill(64)
    fp, q = estimate(DENSE, c, "910b", work), estimate(DENSE, c, "910b", work, quant=w4)
    assert q.parts["compute_s"] == pytest.approx(fp.parts["compute_s"])
    assert q.reads["weights"] < fp.reads["weights"]


def test_a_budget_that_serves_not_one_sequence_names_the_smallest_that_does():
    with pytest.raises(PlanDoesNotFit, match=r"serves one sequence of 32 positions in .* the smallest need is") as e:
        choose_plan(DENSE, 2, "910b", 1000, Workload.serve(32, dtype=F32))
    assert e.value.need > 1000 and e.value.plan


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: Workload.serve(0), r"serve needs a positive context"),
        (lambda: Workload.serve(64, 1.0), r"prompt_share is the share of the tokens processed .* got 1.0"),
        (lambda: Workload.serve(64, -0.1), r"a number in \[0, 1\)"),
        (lambda: Workload.serve(64, math.nan), r"a number in \[0, 1\)"),
        (lambda: Workload.serve(64, "0.5"), r"a number in \[0, 1\)"),
        (lambda: Workload.serve(64, max_seqs=0), r"max_seqs caps the sequences served at once: .* got 0"),
        (lambda: Workload.serve(64, max_seqs=2.0), r"max_seqs caps .* got 2.0"),
        (lambda: Workload.serve(4, 0.9), r"a prompt share of 0.9 leaves no generated token in a context of 4"),
        (
            lambda: choose_plan(DENSE, 2, Device("bare", 0, 1e12, Link(1e9)), 1e9, Workload.serve(32)),
            r"the device profile 'bare' needs a positive finite memory_bytes_per_s to price a plan, got 0",
        ),
        (
            lambda: choose_plan(DENSE, 2, Device("x", 1e12, math.inf, Link(1e9)), 1e9, Workload.serve(32)),
            r"needs a positive finite flop_per_s",
        ),
        (
            lambda: estimate(DENSE, candidates(DENSE, 1)[0], "910b", Workload.serve(32)),
            r"serve_estimate sizes a serving workload's batch",
        ),
    ],
)
def test_bad_serving_input_is_one_line(call, message):
    with pytest.raises(ValueError, match=message) as e:
        call()
    assert "\n" not in str(e.value)
