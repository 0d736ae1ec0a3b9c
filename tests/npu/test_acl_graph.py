"""ACL graph capture (npugraph_ex): the capture order's hazard check on the golden layer-sharded graphs, on
graphs built the way npugraph_ex's passes leave the prefetch (with and without events), and the backend's
one-line refusal off an NPU."""

from pathlib import Path

import pytest
import torch

from functional_npu.core import collectives  # noqa: F401 - defines functional_npu::broadcast_into
from functional_npu.npu import acl_graph
from functional_npu.parallel import hazard
from functional_npu.runtime.serving.backends import BACKENDS, resolve_backend
from tools.aten_graphs import CASES, LAYER_SHARD_LAYERS, read_artifact

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
LAYER_SHARDED = [c for c in CASES if c.series is not None]

if not hasattr(torch.ops.npugraph_ex, "scope_enter"):  # the schemas npugraph_ex defines (ops/, scope/): no kernels
    _lib = torch.library.Library("npugraph_ex", "FRAGMENT")
    _lib.define("scope_enter(str[] keys, str[] values, bool need_execute=False) -> None")
    _lib.define("scope_exit(bool need_execute=False) -> None")
    _lib.define("tagged_event_record(str tag, bool created_inside=False) -> ()")
    _lib.define("tagged_event_wait(str tag, bool created_inside=False) -> ()")


# ---- the golden artifacts ------------------------------------------------------------------------
@pytest.mark.parametrize("case", LAYER_SHARDED, ids=lambda c: c.name)
def test_golden_layer_sharded_capture_is_safe(case):
    report = read_artifact(GRAPHS, case.name, "acl_prefetch.json")
    assert report["ok"], report["problems"]
    assert report["problems"] == []
    assert report["allocated_prefetch_bytes"] == 0  # the ring is the graph's input: reinplaced, no copy back
    assert report["ring_slots"] == case.k + 1
    assert report["broadcasts"] == LAYER_SHARD_LAYERS
    assert report["broadcast_streams"] == ["prefetch"]  # one side stream, reused by every layer
    graph = read_artifact(GRAPHS, case.name, "acl_graph.txt")
    assert "functional_npu.broadcast_into.default" in graph and "auto_functionalized" not in graph
    assert "aten.copy_.default" not in graph  # no epilogue writing the ring back


def test_golden_control_without_events_fails():
    report = read_artifact(GRAPHS, "qwen3-dp2-layer_shard-k1-decode", "acl_prefetch_no_events.json")
    assert not report["ok"]
    # npugraph_ex refuses to reinplace a mutated input used across streams without events: the slots are cloned
    assert report["allocated_prefetch_bytes"] > 0


def test_golden_streams_name_one_side_stream():
    streams = read_artifact(GRAPHS, "qwen3-dp2-layer_shard-k2-decode", "acl_streams.json")
    assert set(streams["streams"]) == {"main", "prefetch"}
    assert streams["labels"] == ["prefetch"]
    assert not streams["unmatched"]


# ---- graphs built the way npugraph_ex leaves the prefetch -----------------------------------------
def _graph(k: int, layers: int, *, events: bool = True, shift: int = 0) -> torch.fx.GraphModule:
    """The decoder's layer loop as npugraph_ex captures it: per layer ``i``, the broadcast of layer ``i + k`` into slot
    ``(i + k) mod (k + 1)`` on the ``prefetch`` stream, then the wait and the read of layer ``i``'s slot on main."""
    g = torch.fx.Graph()
    slots = [g.placeholder(f"slot{s}") for s in range(k + 1)]
    for s in slots:
        s.meta["val"] = torch.empty(16, device="meta")
    x = g.placeholder("x")
    ops = torch.ops
    for i in range(layers):
        v = i + k + shift  # shift: the slot index computed wrongly
        if events:
            g.call_function(ops.npugraph_ex.tagged_event_record.default, ("fnpu.issue", True))
        g.call_function(ops.npugraph_ex.scope_enter.default, (["_user_stream_label"], ["prefetch"]))
        if events:
            g.call_function(ops.npugraph_ex.tagged_event_wait.default, ("fnpu.issue", True))
        g.call_function(ops.functional_npu.broadcast_into.default, (slots[v % (k + 1)], [], x, 1, "0", 2))
        if events:
            g.call_function(ops.npugraph_ex.tagged_event_record.default, (f"fnpu.slot{v % (k + 1)}", True))
        g.call_function(ops.npugraph_ex.scope_exit.default, ())
        if events and i >= k:
            g.call_function(ops.npugraph_ex.tagged_event_wait.default, (f"fnpu.slot{i % (k + 1)}", True))
        w = g.call_function(ops._c10d_functional.wait_tensor.default, (slots[i % (k + 1)],))
        x = g.call_function(ops.aten.add.Tensor, (x, w))
    g.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("k,layers", [(k, n) for k in (0, 1, 2) for n in (1, 3, 4, 7) if k < n])
def test_synthetic_capture_with_events_is_safe(k, layers):
    report = acl_graph.prefetch_report(_graph(k, layers), k)
    assert report["ok"], report["problems"]
    assert report["broadcast_streams"] == ["prefetch"]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_synthetic_capture_without_events_fails(k):
    problems = acl_graph.prefetch_report(_graph(k, 4, events=False), k)["problems"]
    # nothing orders a broadcast on the side stream with the reads on main: every write races every read of its slot
    assert sum(p.startswith("write after read") for p in problems) >= 4, problems


def test_capture_order_streams_and_events():
    order = acl_graph.capture_order(_graph(1, 3))
    writes = [op for op, node in order.nodes.items() if "broadcast_into" in str(node.target)]
    assert {order.stream[w] for w in writes} == {"prefetch"}
    assert [t for _, _, t in order.events].count("fnpu.issue") == 3
    prog, found = acl_graph.program(order, 1)
    assert found["allocs"] == {} and len(found["slots"]) == 2
    assert hazard.check(prog, 1, slots=2) == []


def test_a_wrong_slot_index_reads_the_wrong_layer():
    report = acl_graph.prefetch_report(_graph(1, 3, shift=1), 1)
    assert not report["ok"]
    assert any("reads layer" in p for p in report["problems"]), report["problems"]


def test_slot_one_too_few_is_a_bound_violation():
    report = acl_graph.prefetch_report(_graph(2, 5), 1)  # a ring of 3 slots checked as k = 1 (2 slots)
    assert not report["ok"]


# ---- the backend -----------------------------------------------------------------------------------
def test_npugraph_ex_is_a_backend_and_refuses_off_an_npu():
    assert "npugraph_ex" in BACKENDS
    with pytest.raises(ValueError) as e:
        resolve_backend("npugraph_ex")
    assert "\n" not in str(e.value) and "npugraph_ex" in str(e.value)
    with pytest.raises(ValueError):
        resolve_backend("npugraph_ex", device_type="cpu")
    assert resolve_backend("inductor").name == "inductor"  # the others still work


# ---- the conversion itself ---------------------------------------------------------------------------
def test_conversion_of_one_case_reproduces_its_golden_artifacts():
    from tools.acl_graphs import CONTROL, acl_artifacts
    from tools.aten_graphs import diff_artifacts

    artifacts, problems, skipped = acl_artifacts([CONTROL])
    if skipped:
        pytest.skip(skipped)
    assert problems == []
    assert set(artifacts[CONTROL]) == {
        "acl_graph.txt",
        "acl_streams.json",
        "acl_prefetch.json",
        "acl_prefetch_no_events.json",
        "acl_checks.json",
        "acl_checks_no_events.json",
        "acl_replay.json",
    }
    assert diff_artifacts(artifacts, GRAPHS) == []  # the same graph alone as among every case: no per-process names
