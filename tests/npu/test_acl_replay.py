"""Replays through npugraph_ex's capture path on stand-ins (functional_npu/npu/acl_replay.py), run once per module in a
process of their own (tests/npu/acl_replay_driver.py): npugraph_ex's own recapture check counts a capture again
exactly when a written-in-place input moved (a planted ring that turns between calls, and the layer-sharded k = 2
decode case); the refused options would hide that, fall back or not compile; the copy check passes a slot written in
place and fails npugraph_ex's clone of it; the recapture check's message; the golden replays."""

import pytest

from functional_npu.npu import acl_replay
from functional_npu.runtime.serving.backends import REFUSED_NPUGRAPH_EX_OPTIONS
from tests.npu.acl_replay_driver import GOLDEN_STEPS, STEPS
from tools.aten_graphs import CASES, read_artifact

from ..support import GRAPHS, run_driver

MOVES = "(a ring slot or cache that moves between steps)"
RING = "(written in place by the graph: a ring slot or a cache)"
RINGED = [c for c in CASES if c.ringed and c.phase != "train"]  # layer-sharded and host series
PAGED = [c for c in CASES if c.paged]  # the serving engine's steps: pools and block tables written in place


@pytest.fixture(scope="module")
def runs():
    return run_driver("tests.npu.acl_replay_driver", [], "npugraph_ex replay")


def _changes(sequence):
    return sum(a != b for a, b in zip(sequence, sequence[1:]))


def test_npugraph_ex_recaptures_exactly_when_a_written_input_moved(runs):
    """The layer-sharded k = 2 decode: L = 4 layers turn a ring of 3 slots by 1 between steps. Whatever graphs dynamo
    compiles, npugraph_ex's count is the number of calls whose slot addresses differ from the call before."""
    report = runs["golden"]
    assert report["steps"] == GOLDEN_STEPS
    assert sum(g["calls"] for g in report["graphs"].values()) == GOLDEN_STEPS
    for graph in report["graphs"].values():
        assert graph["recaptures"] == _changes(graph["address_sequence"]) == graph["captures"] - 1
        slots = [[a for a in t if "prefetched" in a] for t in graph["address_tuples"]]
        assert all(sorted(s) == [f"state.prefetched[{i}]" for i in range(3)] for s in slots)
    assert bool(acl_replay.recapture_problems(report)) == (report["recaptures"] > 0)


def test_a_planted_turning_ring_is_captured_again_at_every_call(runs):
    graph = runs["turning"]["graphs"]["graph_1"]
    assert graph["address_tuples"] == [["ring[0]"], ["ring[1]"], ["ring[2]"]]
    assert graph["address_sequence"] == [0, 1, 2, 0][:STEPS]
    assert (graph["captures"], graph["recaptures"], graph["graph_keys"]) == (STEPS, STEPS - 1, 1)
    assert acl_replay.recapture_problems(runs["turning"]) == [
        f"recapture: graph_1 is captured again {STEPS - 1} time(s) in {STEPS} calls: its mutated inputs came at 3 "
        f"different address tuples {MOVES}"
    ]


def test_a_ring_that_stays_is_captured_once(runs):
    graph = runs["still"]["graphs"]["graph_1"]
    assert graph["address_tuples"] == [["ring[0]"]] and graph["captures"] == 1 and graph["recaptures"] == 0
    assert acl_replay.recapture_problems(runs["still"]) == []


def test_capture_limit_counts_graphs_held_and_a_recapture_at_the_limit_falls_back_to_eager(runs):
    graph = runs["limited"]["graphs"]["graph_1"]  # capture_limit=1: one graph held, so its first recapture
    assert graph["captures"] == 1 and graph["fallback_to_eager"] and graph["eager_calls"] == STEPS - 1
    assert acl_replay.recapture_problems(runs["limited"]) == [
        "recapture: graph_1 reached npugraph_ex's capture_limit and runs eagerly from then on"
    ]


def test_skipping_the_validation_replays_at_the_captured_address(runs):
    """Why unsafe_skip_npugraph_capture_validation is refused: the ring moved, nothing is captured again, so the
    captured graph writes ring[0] at every step."""
    graph = runs["unsafe_skip"]["graphs"]["graph_1"]
    assert len(graph["address_tuples"]) == 3 and graph["captures"] == 1 and graph["recaptures"] == 0


def test_forced_recaptures_are_counted_as_such(runs):
    graph = runs["forced"]["graphs"]["graph_1"]
    assert graph["address_tuples"] == [["ring[0]"]] and graph["forced_recaptures"] == STEPS - 1
    assert acl_replay.recapture_problems(runs["forced"]) == [
        f"recapture: graph_1 is captured again {STEPS - 1} time(s) in {STEPS} calls: force_recapture"
    ]


def test_npugraph_ex_config_refuses_each_option_in_one_line_and_takes_the_others(runs):
    refused = runs["refused"]["refused"]
    modes = {f"capture_error_mode={m}" for m in ("relaxed", "thread_local")}
    assert set(refused) == {f"{n}={v[0]}" for n, v in REFUSED_NPUGRAPH_EX_OPTIONS.items()} | modes
    for key, message in refused.items():
        name, value = key.split("=")
        shown = repr(REFUSED_NPUGRAPH_EX_OPTIONS[name][0]) if name in REFUSED_NPUGRAPH_EX_OPTIONS else repr(value)
        assert message.startswith(f"npugraph_ex option {name}={shown} is refused: ") and "\n" not in message
    assert runs["refused"]["accepted"] == ["capture_limit", "clone_input", "clone_output", "deadlock_check"]


def test_every_capture_runs_in_the_global_capture_mode(runs):
    """The mode npugraph_ex's own generated module hands to the capture (its ``AclGraphCacheInfo``): "global" for the
    golden replay and every config of ``npugraph_ex_config``; the planted "relaxed" config reaches the capture as
    such, so the check reads the real field."""
    for run in ("golden", "turning", "still", "limited"):
        assert {g["capture_error_mode"] for g in runs[run]["graphs"].values()} == {"global"}, run
    assert {g["capture_error_mode"] for g in runs["relaxed"]["graphs"].values()} == {"relaxed"}


def test_the_copy_check_passes_a_slot_written_in_place_and_fails_npugraph_ex_cloning_it(runs):
    """A slot broadcast into on the capture stream is written where it lies; on a side stream with no events npugraph_ex
    cannot prove its users safe, so it clones the slot, broadcasts into the clone and copies it back."""
    assert runs["copies_ring"] == []
    assert runs["copies_unordered"] == [
        f"copy: clone_default (aten.clone.default) copies graph input arg1_1 {RING}: an input is used where it lies",
        f"copy: copy_ (aten.copy_.default) copies into graph input arg1_1 {RING} what broadcast_into_default wrote: a "
        "ring slot is written by its broadcast only",
    ]


def test_without_input_inplace_pass_writes_into_inputs_stay_out_of_place(runs):
    """Why input_inplace_pass=False is refused: the ring's broadcast does not compile, an in-place add becomes an add
    and a copy back (allowed by the copy check: a computed value into an input no collective writes)."""
    assert len(runs["no_inplace_ring"]) == 1 and "is not pickleable" in runs["no_inplace_ring"][0]
    assert runs["no_inplace_bump"]["targets"] == ["aten.add.Tensor", "aten.sum.default", "aten.copy_.default"]
    assert runs["no_inplace_bump"]["copies"] == []


def test_a_graph_captured_again_is_one_line():
    report = {
        "graphs": {
            "graph_1": {
                "calls": 6,
                "address_tuples": [["a"], ["b"]],
                "recaptures": 5,
                "recaptures_for_core_limits": 0,
                "forced_recaptures": 0,
                "fallback_to_eager": False,
            },
            "graph_2": {
                "calls": 6,
                "address_tuples": [["a"]],
                "recaptures": 0,
                "recaptures_for_core_limits": 0,
                "forced_recaptures": 0,
                "fallback_to_eager": False,
            },
        }
    }
    assert acl_replay.recapture_problems(report) == [
        "recapture: graph_1 is captured again 5 time(s) in 6 calls: its mutated inputs came at 2 different address "
        "tuples (a ring slot or cache that moves between steps)"
    ]


# ---- the golden artifacts (python -m tools.graphs writes them) ------------------------------------------------------
@pytest.mark.parametrize("case", RINGED, ids=lambda c: c.name)
def test_golden_replays_capture_each_graph_once(case):
    replay = read_artifact(GRAPHS, case.name, "acl_replay.json")
    assert replay["problems"] == [] and replay["recaptures"] == 0
    assert 1 <= len(replay["graphs"]) <= case.k + 1  # one graph per ring phase at most
    for graph in replay["graphs"].values():
        assert len(graph["address_tuples"]) == 1 and graph["captures"] == 1


@pytest.mark.parametrize("case", PAGED, ids=lambda c: c.name)
def test_golden_paged_steps_replay_one_graph_at_stable_addresses(case):
    """The pools and block tables are inputs the step writes in place (the KV writes through the table): every call
    finds them at the same addresses, so npugraph_ex captures the step once and replays it."""
    replay = read_artifact(GRAPHS, case.name, "acl_replay.json")
    assert replay["problems"] == [] and replay["recaptures"] == 0
    (graph,) = replay["graphs"].values()
    assert len(graph["address_tuples"]) == 1 and graph["captures"] == 1
