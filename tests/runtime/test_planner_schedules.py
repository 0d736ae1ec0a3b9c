"""The candidates the planner prices but this library does not run yet: two-batch overlap (one micro-batch's
collectives beside the other's compute) and prefill and decode on separate device groups (the prompt's KV cache
moved between them). Each is priced from the serial step model's own parts, shown beside the plans the library runs,
and never chosen; the KV a disaggregated deployment moves is counted from the config alone."""

import dataclasses
import math

import pytest
import torch

from functional_npu.parallel.devices import Link, device
from functional_npu.parallel.plan import Plan
from functional_npu.runtime.planning import (
    Candidate,
    Disaggregated,
    Workload,
    choose_plan,
    disaggregated_estimate,
    estimate,
)
from functional_npu.runtime.planning.step_model import sequence_kv_bytes

from ..support.configs import DENSE, MOE

F32 = torch.float32
EP = Plan(expert_axes=("dp", "tp"))
AXES = {"dp": 4, "tp": 1}
# a device whose links are slow: expert dispatch dominates a decode step, so overlapping it pays
SLOW = dataclasses.replace(device("910b"), link=Link(1e6, 5e-6), links=1, step_overhead_s=1e-3, measured={})


def _halves(work: Workload, serial: Candidate):
    half = estimate(MOE, serial, SLOW, dataclasses.replace(work, batch=work.batch // 2))
    busy = max(half.parts["memory_s"], half.parts["compute_s"])
    comm = sum(v for k, v in half.parts.items() if k not in ("memory_s", "compute_s", "fixed_s"))
    return busy, comm


def test_two_batch_overlap_is_the_larger_of_two_halves_busy_time_and_their_communication():
    """Decode of 64 sequences over EP 4 on slow links: the overlapped step is ``max(2 busy, 2 comm)`` of the half
    batch's serial parts, plus one layer's unhidden share and the fixed cost once; it beats the serial step there,
    and it loses where the step is weight reads (each half reads the weights again)."""
    serial = Candidate("ep", AXES, EP)
    overlap = dataclasses.replace(serial, schedule="two_batch")
    work = Workload.decode(64, 32, F32)
    busy, comm = _halves(work, serial)
    assert comm > busy  # the counterexample's premise: communication dominates the half step
    e = estimate(MOE, overlap, SLOW, work)
    expected = max(2 * busy, 2 * comm) + min(busy, comm) / MOE.num_layers + 1e-3
    assert e.step_s == pytest.approx(expected, rel=1e-12)
    assert e.step_s < estimate(MOE, serial, SLOW, work).step_s
    assert not e.runs and e.bytes == estimate(MOE, serial, SLOW, work).bytes  # the whole batch's bytes
    fast = dataclasses.replace(SLOW, link=Link(1e13, 0.0), links=7)  # nothing to hide: weights read twice
    assert estimate(MOE, overlap, fast, work).step_s > estimate(MOE, serial, fast, work).step_s


def test_one_sequence_per_rank_runs_as_one_batch():
    serial = Candidate("ep", AXES, EP)
    work = Workload.decode(4, 32, F32)  # one per dp rank: nothing to split
    e = estimate(MOE, dataclasses.replace(serial, schedule="two_batch"), SLOW, work)
    assert e.step_s == estimate(MOE, serial, SLOW, work).step_s


def test_the_chosen_plan_is_always_one_the_library_runs():
    """Where two-batch overlap is modelled best, it is ranked first among the candidates and marked, the chosen
    plan is the best one the library runs, and the report names the overlap and its modelled gain. (1.4 MB: only
    the expert-parallel plans and the tp 2 ones fit.)"""
    _, report = choose_plan(MOE, 4, SLOW, 1.4e6, Workload.decode(64, 32, F32))
    best = min((e for e in report.ranked if e.fits), key=lambda e: e.step_s)
    assert best.candidate.schedule == "two_batch" and not best.runs
    assert report.chosen.runs and report.chosen is not best
    assert f"not yet run by this library, {best.candidate.name} is modelled" in report.why()
    assert "(not yet run by this library)" in report.table()
    assert all(row["runs"] == (row["plan"].find("two-batch") < 0) for row in report.to_dict()["candidates"])


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match=r"schedule must be one of \('serial', 'two_batch'\), got 'pipelined'"):
        Candidate("x", AXES, EP, schedule="pipelined")


def test_a_prompt_kv_moved_per_decode_rank_is_counted_from_the_config():
    """One prompt of 40 positions under tp 2: each decode rank receives K and V of its kv heads at every layer,
    in whole blocks of 16 positions."""
    c = Candidate("d", {"dp": 1, "tp": 2}, Plan())
    heads = DENSE.num_kv_heads // 2
    blocks = math.ceil(40 / 16) * 16
    assert sequence_kv_bytes(DENSE, c, 40, F32) == DENSE.num_layers * 2 * heads * DENSE.head_dim * blocks * 4
    assert sequence_kv_bytes(DENSE, c, 40, torch.bfloat16) == DENSE.num_layers * 2 * heads * DENSE.head_dim * blocks * 2


def test_a_disaggregated_split_serves_what_its_slowest_side_allows():
    """Prefill on 2 devices, decode on 2: the deployment serves the least of its prefill's prompt tokens, the prompts
    the link delivers, and its decode's generated tokens, each over its share of the tokens; a slow link between
    nodes of 2 (the groups sit on two) makes the KV transfer the limit."""
    pre, dec = Candidate("p", {"dp": 2, "tp": 1}, Plan()), Candidate("d", {"dp": 1, "tp": 2}, Plan())
    work = Workload.serve(64, 0.5, dtype=F32)
    for link, limit in ((Link(1e11, 1e-6), None), (Link(1e3, 1e-3), "KV transfer")):
        dev = dataclasses.replace(device("910b"), node_size=2, inter_node=link, step_overhead_s=1e-3)
        d = disaggregated_estimate(DENSE, pre, dec, dev, work, memory_per_device=1e8)
        kv = DENSE.num_layers * 2 * 1 * DENSE.head_dim * 32 * 4  # 32 prompt positions, 1 kv head per rank
        assert d.kv_bytes == kv and d.kv_s == pytest.approx(link.alpha_s + kv / link.bytes_per_s)
        prefill = 2 * 32 / d.prefill.step_s / 0.5
        carried = 1 / d.kv_s * 32 / 0.5
        decode = d.decode.tokens_per_s / 0.5
        assert d.tokens_per_s == pytest.approx(min(prefill, carried, decode))
        assert d.per_device == pytest.approx(d.tokens_per_s / 4) and not d.runs
        assert d.decode.prefill is None  # the decode side runs no prefill
        if limit:
            assert d.limit == limit and d.bottleneck == "KV transfer"


def test_a_serving_report_shows_the_disaggregated_splits_and_never_chooses_one():
    _, report = choose_plan(DENSE, 4, "910b", 1e8, Workload.serve(64, 0.5, dtype=F32))
    split = [e for e in report.ranked if isinstance(e, Disaggregated)]
    assert {(e.prefill_devices, e.decode_devices) for e in split} == {(1, 3), (2, 2), (3, 1)}
    assert report.chosen.runs and all(not e.runs for e in split)
    rows = [r for r in report.to_dict()["candidates"] if r["plan"].startswith("disaggregated")]
    assert len(rows) == 3 and all(r["kv_bytes_per_sequence_per_rank"] > 0 for r in rows)
    _, decode_only = choose_plan(DENSE, 4, "910b", 1e8, Workload.serve(64, dtype=F32))  # no prompt: no split
    assert not any(e.candidate.name.startswith("disaggregated") for e in decode_only.ranked)


@pytest.mark.parametrize(
    "prefill, decode, work, message",
    [
        ({"dp": 0, "tp": 1}, {"dp": 2, "tp": 1}, Workload.serve(64, 0.5), r"the prefill side has no devices \(axes"),
        ({"dp": 2, "tp": 1}, {}, Workload.serve(64, 0.5), r"the decode side has no devices \(axes \{\}\)"),
        ({"dp": 2, "tp": 1}, {"dp": 2, "tp": 1}, Workload.serve(64), r"needs a serving workload with prompt tokens"),
        ({"dp": 2, "tp": 1}, {"dp": 2, "tp": 1}, Workload.decode(2, 8), r"needs a serving workload with prompt"),
    ],
)
def test_a_split_that_cannot_be_priced_is_one_line(prefill, decode, work, message):
    with pytest.raises(ValueError, match=message) as err:
        disaggregated_estimate(
            DENSE, Candidate("p", prefill, Plan()), Candidate("d", decode, Plan()), "910b", work, memory_per_device=1e8
        )
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Workload.decode(2, 8, "bfloat16"), r"workload: dtype is the activations' .* got 'bfloat16'"),
        (lambda: Workload.decode(2, 8, torch.int8), r"got torch.int8; int8 or int4 weights are a QuantConfig"),
        (lambda: Link(0.0), r"Link: bytes_per_s must be a positive finite number, got 0.0"),
        (lambda: Link(1e9, -1e-6), r"Link: alpha_s .* must be finite and >= 0, got -1e-06"),
        (lambda: dataclasses.replace(device("910b"), links=0), r"'ascend-910b': links=0 is not a figure it can take"),
        (lambda: dataclasses.replace(device("910b"), node_size=0), r"node_size=0 is not a figure it can take"),
        (lambda: dataclasses.replace(device("910b"), flop_per_s=math.nan), r"needs a positive finite flop_per_s"),
        (lambda: dataclasses.replace(device("910b"), step_overhead_s=-1.0), r"step_overhead_s=-1.0 is not a figure"),
        (lambda: dataclasses.replace(device("910b"), host_link=Link(1e9, math.inf)), r"alpha_s .* got inf"),
        (lambda: choose_plan(DENSE, 2, "910b", 1e9, Workload.decode(2, 4096)), r"workload: decode context 4097 "
         r"positions is past the model's 4096 \(max_position_embeddings\); give at most 4095"),
        (lambda: choose_plan(DENSE, 2, "910b", 1e9, Workload.serve(5000, 0.5)), r"workload: serve context 5000 "
         r"positions is past the model's 4096"),
    ],
)  # fmt: skip
def test_a_workload_or_profile_figure_no_plan_can_take_is_one_line(make, message):
    """Each refused where the workload, the link or the profile is made (a NaN, a zero node size or a string dtype
    once reached the planner's arithmetic as raw errors)."""
    with pytest.raises(ValueError, match=message) as e:
        make()
    assert "\n" not in str(e.value)
