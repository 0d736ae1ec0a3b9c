"""The invariant mode's NPU graphs (graphs/qwen3-tp*-invariant-*) hold only the invariant functions' ops: every verdict
recomputed from the stored graph text (``ge_graph.pbtxt.gz``, ``acl_graph.txt``) and compared with the JSON stored
beside it; the same cases without the mode, and a planted fused op, fail."""

import pytest

from functional_npu.npu import invariant_graph
from tools.aten_graphs import CASES, PHASES, read_artifact
from tools.fx_text import parse_fx_text

from ..support import GRAPHS, golden

INVARIANT = [c for c in CASES if c.invariant]


def acl(name: str, text: str | None = None) -> dict:
    return invariant_graph.acl_check(
        parse_fx_text(read_artifact(GRAPHS, name, "acl_graph.txt") if text is None else text)
    )


def test_there_are_invariant_cases_at_tp_1_and_2():
    assert sorted((c.tp, c.phase) for c in INVARIANT) == [(t, p) for t in (1, 2) for p in sorted(PHASES)]


@pytest.mark.parametrize("case", INVARIANT, ids=lambda c: c.name)
def test_golden_ge_graph_holds_only_adds_multiplies_and_exact_ops(case):
    found = invariant_graph.ge_check(golden.ge_ops(case.name))
    assert found == read_artifact(GRAPHS, case.name, "ge_invariant.json")
    assert found["ok"], found["problems"]
    assert {"Add", "Mul", "RealDiv", "Cast"} <= set(found["ops"]["rounded"])
    assert {"Round", "FloorMod", "Mul", "Add"} <= set(found["float64"])  # rotary's angles, reduced in double
    assert ("HcomAllGather" in found["ops"]["moves"]) == (case.tp > 1)  # the tp sum: gathered, added in rank order


@pytest.mark.parametrize("case", INVARIANT, ids=lambda c: c.name)
def test_golden_acl_graph_holds_only_adds_multiplies_and_exact_ops(case):
    found = acl(case.name)
    assert found == read_artifact(GRAPHS, case.name, "acl_invariant.json")
    assert found["ok"], found["problems"]
    assert {"add.Tensor", "mul.Tensor", "div.Tensor"} <= set(found["ops"]["rounded"])


@pytest.mark.parametrize("phase", PHASES)
def test_the_same_case_without_the_mode_fails_naming_its_matmuls_and_reductions(phase):
    ge = invariant_graph.ge_check(golden.ge_ops(f"qwen3-tp1-{phase}"))
    assert not ge["ok"] and {"MatMul", "BatchMatMul", "ReduceMean", "SoftmaxV2"} <= set(ge["ops"]["other"])
    assert any(p.startswith("MatMul x") and "order of its own" in p for p in ge["problems"])
    assert any(p.startswith("Pow (") and "a graph input reaches" in p for p in ge["problems"])  # RMSNorm's square
    found = acl(f"qwen3-tp1-{phase}")
    assert not found["ok"] and {"mm.default", "bmm.default", "mean.dim"} <= set(found["ops"]["other"])


def test_a_planted_fused_op_fails():
    name = INVARIANT[0].name
    text = read_artifact(GRAPHS, name, "ge_graph.pbtxt.gz").replace('type: "Mul"', 'type: "FusedMulAdd"', 1)
    assert invariant_graph.ge_check(golden.ge_ops(name, text))["problems"] == [
        "FusedMulAdd x1 (first Mul): not an op of the invariant functions; it may reduce or round in an order of its "
        "own"
    ]
    text = read_artifact(GRAPHS, name, "acl_graph.txt").replace("aten.mul.Tensor", "aten.addcmul.default", 1)
    assert [p.split(" (")[0] for p in acl(name, text)["problems"]] == ["addcmul.default x1"]
