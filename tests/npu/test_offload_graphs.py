"""vLLM's issue 54975 in the golden graphs: 3 modules (layers) with their ``o_proj`` and ``down`` kept in host memory,
the prefetch ring filled by copies from there. At k = 2 the ring's 3 slots divide the 3 layers: one graph, one phase.
At k = 1 they do not: two phases, a graph each. In every artifact kind (the aten FX graph every compiler starts from,
torchair's GE graph, npugraph_ex's ACL graph) the hazard check finds nothing and every read is of its own layer's slot;
the ACL graph's capture checks find nothing and its replay captures each graph once. The phase-0 graph run as a step
of phase 1 (the ring not turned, 54975's bug) reads the wrong layers."""

import pytest

from functional_npu.checks import check, expected_slot, from_fx
from functional_npu.npu import acl_graph
from functional_npu.npu.ge_graph import ring_program
from functional_npu.parallel.prefetch_ring import phases
from tools.aten_graphs import CASES, read_artifact

from ..support import GRAPHS, golden

BY_NAME = {c.name: c for c in CASES}


def _aten(case, phase):
    program = from_fx(golden.fx_graph(case.name), case.k, case.ring_groups, copy_back=False, phase=phase)
    return check(program, case.k, case.ring_groups * (case.k + 1)), program


def _ge(case):
    found = golden.ge_ring_check(case)
    program, _ = ring_program(
        golden.ge_ops(case.name), k=case.k, inputs=golden.inputs(case.name), phase=case.ring_phase
    )
    return found["problems"], program


def _acl(case):
    gm = golden.acl_module(case.name)
    found = acl_graph.prefetch_report(gm, case.k, phase=case.ring_phase)
    return found["problems"], acl_graph.program(acl_graph.capture_order(gm), case.k, phase=case.ring_phase)[0]


def _reads_own_layers(case, program):
    """Every read names a layer, each of the case's layers is read, and each from the slot that layer belongs in."""
    layers = case.config.num_layers
    assert sorted({layer for _, layer in program.reads.values()}) == list(range(layers)), program.reads
    for read, (slot, layer) in program.reads.items():
        assert program.slot_index[slot] == expected_slot(layer, case.k, case.ring_phase), (read, slot, layer)


def _clean_in_every_kind(case):
    problems, program = _aten(case, case.ring_phase)
    assert problems == []
    _reads_own_layers(case, program)
    for kind in (_ge, _acl):
        problems, program = kind(case)
        assert problems == [], (kind.__name__, problems)
        _reads_own_layers(case, program)
    checks = read_artifact(GRAPHS, case.name, "acl_checks.json")
    assert checks["join"] == [] and checks["copies"] == []  # capture would not fail
    replay = read_artifact(GRAPHS, case.name, "acl_replay.json")
    assert replay["problems"] == [] and replay["recaptures"] == 0  # capture is stable
    assert len(replay["graphs"]) == phases(case.config.num_layers, case.k)  # a graph per phase, each captured once
    assert all(g["captures"] == 1 and len(g["address_tuples"]) == 1 for g in replay["graphs"].values())


def test_vllm_54975_three_modules_at_k2_every_check_is_clean_and_reads_its_own_layers():
    case = BY_NAME["qwen3-tp1-offload-L3-k2-decode"]
    assert case.config.num_layers == 3 and case.k == 2 and case.offload == "o_proj,down_proj"
    _clean_in_every_kind(case)


@pytest.mark.parametrize("name", ["qwen3-tp1-offload-L3-k1-decode", "qwen3-tp1-offload-L3-k1-phase1-decode"])
def test_vllm_54975_three_modules_at_k1_each_phases_graph_reads_its_own_layers(name):
    case = BY_NAME[name]
    assert case.config.num_layers == 3 and case.k == 1 and phases(3, 1) == 2
    _clean_in_every_kind(case)


def test_vllm_54975_the_phase_0_graph_run_as_phase_1_reads_the_wrong_layers():
    """The ring not turned: phase 0's graph at the second step, whose layer 0 the first step left in slot 1."""
    problems, _ = _aten(BY_NAME["qwen3-tp1-offload-L3-k1-decode"], phase=1)
    assert problems == [
        "the right layer: auto_functionalized_v2 writes layer 1 into arg6_1 (ring slot 1); layer 1 belongs in ring "
        "slot 0",
        "the right layer: auto_functionalized_v2_1 writes layer 2 into arg5_1 (ring slot 0); layer 2 belongs in ring "
        "slot 1",
        "the right layer: auto_functionalized_v2_2 writes layer 3 into arg6_1 (ring slot 1); layer 3 belongs in ring "
        "slot 0",
        "the right layer: mm_1 reads layer 0 from arg5_1 (ring slot 0), which holds no layer of this step then",
        "the right layer: mm_3 reads layer 0 from arg5_1 (ring slot 0), which holds no layer of this step then",
    ]
