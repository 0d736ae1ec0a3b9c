"""The invariant modes' NPU graphs: the portable mode's (graphs/qwen3-tp*-invariant-*) hold only the invariant
functions' ops, the batch mode's (graphs/qwen3-tp*-batch_invariant-*) those and matmuls at pinned shapes. Every verdict
recomputed from the stored graph text (``ge_graph.pbtxt.gz``, ``acl_graph.txt``) and compared with the JSON stored
beside it; the same cases without the mode, a planted fused op and a matmul of unpinned rows fail."""

from collections import Counter

import pytest

from functional_npu.models import batch_invariant
from functional_npu.npu import invariant_graph
from tools.aten_graphs import CASES, GRAPH_CONFIGS, PHASES, read_artifact
from tools.fx_text import parse_fx_text

from ..support import GRAPHS, golden

INVARIANT = [c for c in CASES if c.invariant is True]
BATCH = [c for c in CASES if c.invariant == "batch"]


def acl(name: str, text: str | None = None) -> dict:
    return invariant_graph.acl_check(
        parse_fx_text(read_artifact(GRAPHS, name, "acl_graph.txt") if text is None else text)
    )


def test_there_are_invariant_cases_of_both_modes_at_tp_1_and_2():
    for cases in (INVARIANT, BATCH):
        assert sorted((c.tp, c.phase) for c in cases) == [(t, p) for t in (1, 2) for p in sorted(PHASES)]


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


@pytest.mark.parametrize("case", BATCH, ids=lambda c: c.name)
def test_golden_batch_mode_ge_graph_reduces_only_in_matmuls_of_pinned_rows(case):
    found = invariant_graph.ge_batch_check(golden.ge_ops(case.name), batch_invariant.ROWS)
    assert found == read_artifact(GRAPHS, case.name, "ge_invariant.json")
    assert found["ok"], found["problems"]
    assert set(found["ops"]["pinned"]) == {"MatMul", "BatchMatMul"}  # linears, row sums; attention's blocks
    assert not {"ReduceSum", "ReduceMean", "SoftmaxV2", "Exp", "Log", "Rsqrt"} & set(found["ops"].get("other", {}))
    assert all(m["rows"] % batch_invariant.ROWS == 0 for m in found["matmuls"])
    assert set(found["why"]) == {"rounded", "exact", "moves", "constants", "pinned"}
    attention = [m for m in found["matmuls"] if m["type"] == "BatchMatMul" and m["reduced"] == batch_invariant.KEYS]
    assert len(attention) == GRAPH_CONFIGS[case.family].num_layers  # per layer the values of 64-key blocks
    assert ("HcomAllGather" in found["ops"]["moves"]) == (case.tp > 1)


@pytest.mark.parametrize("tp", (1, 2))
def test_batch_mode_matmuls_reduce_the_same_dims_in_decode_and_prefill(tp):
    """The batch (2 x 1 decode rows, 2 x 16 prefill rows) changes only the matmuls' rows: each reduces over the same
    dims in the same number of matmuls, so a row's order is the kernel's at that shape whatever the batch."""
    reduced = {
        phase: Counter(
            (m["type"], m["reduced"])
            for m in invariant_graph.ge_batch_check(
                golden.ge_ops(f"qwen3-tp{tp}-batch_invariant-{phase}"), batch_invariant.ROWS
            )["matmuls"]
        )
        for phase in PHASES
    }
    assert reduced["decode"] == reduced["prefill"]
    rows = {
        phase: {
            m["rows"]
            for m in read_artifact(GRAPHS, f"qwen3-tp{tp}-batch_invariant-{phase}", "ge_invariant.json")["matmuls"]
        }
        for phase in PHASES
    }
    assert rows["decode"] != rows["prefill"]  # the rows do change: the check is not of two equal graphs


@pytest.mark.parametrize("case", BATCH, ids=lambda c: c.name)
def test_golden_batch_mode_acl_graph_holds_matmuls_and_the_invariant_ops(case):
    found = invariant_graph.acl_batch_check(parse_fx_text(read_artifact(GRAPHS, case.name, "acl_graph.txt")))
    assert found == read_artifact(GRAPHS, case.name, "acl_invariant.json")
    assert found["ok"], found["problems"]
    assert set(found["ops"]["pinned"]) == {"mm.default", "bmm.default"}


def test_batch_mode_check_fails_a_matmul_of_unpinned_rows_and_a_reduction():
    name = BATCH[0].name  # decode: 2 rows padded to 4
    ops = golden.ge_ops(name)
    first = next(op for op in ops if op["type"] == "MatMul")
    first["in"][0]["shape"][-1 if first["attrs"].get("transpose_x1") else -2] = 3
    found = invariant_graph.ge_batch_check(ops, batch_invariant.ROWS)
    assert found["problems"] == [
        f"MatMul ({first['name']}): 3 rows, not a multiple of the row tile {batch_invariant.ROWS}: its kernel may "
        f"reduce in another order at another row count"
    ]
    text = read_artifact(GRAPHS, name, "ge_graph.pbtxt.gz").replace('type: "ArgMaxWithValue"', 'type: "ReduceSum"', 1)
    assert [
        p.split(" (")[0]
        for p in invariant_graph.ge_batch_check(golden.ge_ops(name, text), batch_invariant.ROWS)["problems"]
    ] == ["ReduceSum x1"]
    # the portable mode's check refuses the batch mode's graph: its matmuls are no adds and multiplies
    assert any(p.startswith("MatMul x") for p in invariant_graph.ge_check(golden.ge_ops(name))["problems"])
