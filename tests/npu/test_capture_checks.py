"""What ACL graph capture needs of a graph, checked before any device (functional_npu/npu/capture_checks.py): each
check on graphs built with the counterexample planted (an unjoined side stream, copies of inputs, transfers, a
collective's buffer allocated inside, two communication streams at once) and without it; the communication rule
against npugraph_ex's own deadlock_check; the golden artifacts."""

import importlib.util

import pytest
import torch

from functional_npu.core import collectives  # noqa: F401 - defines functional_npu::broadcast_into
from functional_npu.npu import capture_checks
from functional_npu.npu.capture_checks import COMM_BUDGETS, CommBudget
from tools.aten_graphs import CASES, read_artifact

from ..support import GRAPHS, golden, npugraph_ex_ops  # noqa: F401 - defines npugraph_ex's op schemas

ops = torch.ops
JOIN_FAILS = "(ACL capture fails with 107025, a stream not joined to the original stream)"
INPUT_USED = "an input is used where it lies"
RING = "(written in place by the graph: a ring slot or a cache)"


class Builder:
    """An FX graph as npugraph_ex leaves it, node by node, each node named and given its value."""

    def __init__(self) -> None:
        self.g = torch.fx.Graph()

    def input(self, name: str, dtype: torch.dtype = torch.float32) -> torch.fx.Node:
        n = self.g.placeholder(name)
        n.meta["val"] = torch.zeros(16, dtype=dtype)
        return n

    def op(self, name: str, target, *args, val=None, **kwargs) -> torch.fx.Node:
        n = self.g.create_node("call_function", target, args, kwargs, name=name)
        n.meta["val"] = torch.zeros(16) if val is None else val
        return n

    def record(self, tag: str) -> None:
        self.g.call_function(ops.npugraph_ex.tagged_event_record.default, (tag, True))

    def wait(self, tag: str) -> None:
        self.g.call_function(ops.npugraph_ex.tagged_event_wait.default, (tag, True))

    def enter(self, label: str) -> None:
        self.g.call_function(ops.npugraph_ex.scope_enter.default, (["_user_stream_label"], [label]))

    def exit(self) -> None:
        self.g.call_function(ops.npugraph_ex.scope_exit.default, ())

    def bcast(self, name: str, slot: torch.fx.Node, after: torch.fx.Node) -> torch.fx.Node:
        return self.op(name, ops.functional_npu.broadcast_into.default, slot, [], after, 0, "0", 2, val=None)

    def done(self, out: torch.fx.Node) -> torch.fx.GraphModule:
        self.g.output(out)
        return torch.fx.GraphModule(torch.nn.Module(), self.g)


# ---- joins -----------------------------------------------------------------------------------------------------------
def _prefetch(*, join: bool, record_early: bool = False) -> torch.fx.GraphModule:
    """A broadcast into a slot on the ``prefetch`` stream beside an add on main; ``join``: an event recorded after it is
    waited on main before the end; ``record_early``: that event recorded before a second broadcast."""
    b = Builder()
    x, slot = b.input("x"), b.input("slot")
    b.record("go")
    b.enter("prefetch")
    b.wait("go")
    b.bcast("bcast", slot, x)
    if record_early:
        b.record("back")
        b.bcast("bcast2", slot, x)
    elif join:
        b.record("back")
    b.exit()
    y = b.op("y", ops.aten.add.Tensor, x, x)
    if join or record_early:
        b.wait("back")
    return b.done(y)


def test_a_side_stream_joined_before_the_end_passes():
    assert capture_checks.unjoined_streams(_prefetch(join=True)) == []


def test_an_unjoined_side_stream_is_named_with_its_last_op():
    assert capture_checks.unjoined_streams(_prefetch(join=False)) == [
        "join: stream 'prefetch' is not joined to the capture stream before the graph ends: no event recorded after "
        f"its last op bcast is waited on 'main' {JOIN_FAILS}"
    ]


def test_an_event_recorded_before_the_streams_last_op_does_not_join_it():
    assert capture_checks.unjoined_streams(_prefetch(join=False, record_early=True)) == [
        "join: stream 'prefetch' is not joined to the capture stream before the graph ends: no event recorded after "
        f"its last op bcast2 is waited on 'main' {JOIN_FAILS}"
    ]


def test_a_stream_joined_through_another_side_stream_is_joined():
    b = Builder()
    x, slot = b.input("x"), b.input("slot")
    b.record("go")
    b.enter("prefetch")
    b.wait("go")
    b.bcast("bcast", slot, x)
    b.record("to_other")
    b.exit()
    b.enter("other")
    b.wait("to_other")
    b.op("z", ops.aten.mul.Tensor, x, x)
    b.record("back")
    b.exit()
    b.wait("back")
    gm = b.done(b.op("y", ops.aten.add.Tensor, x, x))
    assert capture_checks.unjoined_streams(gm) == []


# ---- copies ----------------------------------------------------------------------------------------------------------
def _copies(plant: str) -> list[str]:
    b = Builder()
    x, slot, w, cache = b.input("x"), b.input("slot"), b.input("w"), b.input("cache")
    b.bcast("bcast", slot, x)
    y = b.op("y", ops.aten.add.Tensor, x, x)
    b.op("act", ops.aten.clone.default, y)  # a copy of an activation: compute
    b.op("cast", ops.aten._to_copy.default, x, dtype=torch.float16, val=torch.zeros(16, dtype=torch.float16))
    b.op("acc", ops.aten.zeros_like.default, x)  # an allocation no collective writes
    b.op("store", ops.aten.copy_.default, cache, y)  # a computed value into an input no collective writes: a cache
    if plant == "transfer":
        b.op("t", ops.aten._to_copy.default, x, device="meta", val=torch.zeros(16, device="meta"))
    elif plant == "item":
        b.op("s", ops.aten._local_scalar_dense.default, x, val=0.0)
    elif plant == "clone_slot":
        b.op("c", ops.aten.clone.default, slot)
    elif plant == "clone_weight_view":
        b.op("c2", ops.aten.clone.default, b.op("v", ops.aten.view.default, w, [4, 4], val=torch.zeros(4, 4)))
    elif plant == "copy_back":
        b.op("back", ops.aten.copy_.default, slot, y)
    elif plant == "copy_from_input":
        b.op("from_w", ops.aten.copy_.default, b.op("tmp", ops.aten.empty_like.default, x), w)
    elif plant == "functionalized":
        bases = {"_slot_base_index": 0, "_all_bases": [slot]}
        op = ops.functional_npu.broadcast_into.default
        b.op(
            "af",
            torch.ops.higher_order.auto_functionalized_v2,
            op,
            parts=[],
            after=x,
            src=0,
            group_name="0",
            size=2,
            **bases,
        )
    elif plant == "alloc":
        buf = b.op("buf", ops.aten.empty.memory_format, [16])
        b.bcast("bcast_buf", buf, x)
    elif plant == "write_back":  # a paged write through a flattened view of the pool, left functional
        pool, rows = b.input("pool"), b.input("rows", torch.long)
        flat = b.op("flat", ops.aten.reshape.default, pool, [-1])
        put = b.op("put", ops.aten.scatter.src, flat, 0, rows, y)
        b.op("back_pool", ops.aten.copy_.default, pool, b.op("unflat", ops.aten.reshape.default, put, [16]))
    elif plant == "write_in_place":  # the same write on the pool itself, in place: the paged cache's form
        pool, rows = b.input("pool"), b.input("rows", torch.long)
        b.op("put", ops.aten.index_put_.default, pool, [rows], y)
    return capture_checks.copies(b.done(y))


def test_compute_copies_casts_and_allocations_no_collective_writes_pass():
    assert _copies("none") == []
    assert _copies("write_in_place") == []


@pytest.mark.parametrize(
    "plant,message",
    [
        (
            "transfer",
            "transfer: t (aten._to_copy.default) puts a value on meta, not cpu, inside the captured region (a "
            "synchronous memcpy in capture fails with 107030)",
        ),
        (
            "item",
            "transfer: s (aten._local_scalar_dense.default) reads a device value on the host (.item()) inside the "
            "captured region",
        ),
        ("clone_slot", f"copy: c (aten.clone.default) copies graph input slot {RING}: {INPUT_USED}"),
        ("clone_weight_view", f"copy: c2 (aten.clone.default) copies graph input w: {INPUT_USED}"),
        (
            "copy_back",
            f"copy: back (aten.copy_.default) copies into graph input slot {RING}, which bcast writes: a ring slot is "
            "written by its broadcast only",
        ),
        ("copy_from_input", f"copy: from_w (aten.copy_.default) copies from graph input w: {INPUT_USED}"),
        (
            "functionalized",
            "copy: af (auto_functionalized_v2 of functional_npu.broadcast_into.default) copies graph input slot "
            f"{RING} to write the copy: npugraph_ex did not reinplace it",
        ),
        (
            "write_back",
            "copy: back_pool (aten.copy_.default) writes graph input pool back whole from put (aten.scatter.src): "
            "npugraph_ex did not reinplace the write, a copy of the whole input each replay",
        ),
        (
            "alloc",
            "alloc: buf (aten.empty.memory_format) allocates the buffer bcast_buf writes inside the captured region: a "
            "prefetch buffer is the ring, a graph input",
        ),
    ],
)
def test_each_planted_copy_is_found_with_its_message(plant, message):
    assert _copies(plant) == [message]


# ---- communication streams -------------------------------------------------------------------------------------------
def _comm(*, ordered: bool) -> torch.fx.GraphModule:
    """A TP all-reduce on main and a ring broadcast on ``prefetch``; ``ordered``: the broadcast's stream enters after
    the all-reduce (event ``go`` recorded after it), and main waits for the broadcast before going on."""
    b = Builder()
    x, slot = b.input("x"), b.input("slot")
    y = b.op("y", ops.aten.add.Tensor, x, x)
    if not ordered:
        b.record("go")
    ar = b.op("ar", ops._c10d_functional.all_reduce_.default, y, "sum", "0")
    if ordered:
        b.record("go")
    b.enter("prefetch")
    b.wait("go")
    b.bcast("bcast", slot, x)
    b.record("back")
    b.exit()
    b.wait("back")
    return b.done(b.op("z", ops._c10d_functional.wait_tensor.default, ar))


def test_one_communication_stream_at_a_time_passes_every_budget():
    gm = _comm(ordered=True)
    got = capture_checks.concurrent_comm(gm)
    assert got["streams"] == {"main": ["ar"], "prefetch": ["bcast"]} and got["max_concurrent"] == 1
    assert all(capture_checks.comm_problems(gm, budget) == [] for budget in COMM_BUDGETS.values())


def test_two_communication_streams_at_once_exceed_one_vector_core_budget():
    gm = _comm(ordered=False)
    assert capture_checks.concurrent_comm(gm)["at_once"] == ["ar", "bcast"]
    assert capture_checks.comm_problems(gm, COMM_BUDGETS["ascend-910b"]) == [
        "comm: 2 streams may run communication at once (ar on 'main', bcast on 'prefetch'); ascend-910b allows 1 (40 "
        "vector cores, an AIV collective may hold 40): concurrent AIV collectives over the device's vector cores "
        "deadlock (npugraph_ex's deadlock_check)"
    ]
    assert capture_checks.comm_problems(gm, CommBudget("half", 48, 24)) == []  # collectives of half the cores: 2 fit


def test_the_budgets_are_one_stream_on_both_ascend_profiles():
    assert {name: b.streams for name, b in COMM_BUDGETS.items()} == {"ascend-910b": 1, "ascend-910c": 1}


def _deadlock_check():
    """npugraph_ex's own tools/aclgraph_check/deadlock_check.py (standard library only), loaded from the wheel."""
    from functional_npu.npu import TorchairUnavailable, torchair_sources

    try:
        path = torchair_sources() / "npugraph_ex" / "tools" / "aclgraph_check" / "deadlock_check.py"
    except TorchairUnavailable as e:
        pytest.skip(str(e))
    spec = importlib.util.spec_from_file_location("npugraph_ex_deadlock_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("ordered", [True, False])
def test_the_rule_is_npugraph_ex_deadlock_checks_own(ordered):
    dc = _deadlock_check()
    gm = _comm(ordered=ordered)
    budget = COMM_BUDGETS["ascend-910c"]
    tasks = dc._build_stream_tasks(capture_checks.deadlock_trace(gm, budget.collective_cores))
    vc, index = dc._compute_vector_clocks(tasks, dc._build_sync_pairs(tasks))
    pairs = [sorted(t["name"] for t in pair) for pair in dc._find_deadlock_tasks(tasks, vc, index, budget.vector_cores)]
    assert pairs == ([] if ordered else [["aiv_ar", "aiv_bcast"]])
    assert bool(pairs) == bool(capture_checks.comm_problems(gm, budget))


# ---- the golden artifacts (python -m tools.graphs writes them) ------------------------------------------------------
ACL_CASES = [c for c in CASES if c.phase != "train"]
RINGED = [c for c in ACL_CASES if c.ringed]  # the layer-sharded cases and those with series in host memory


@pytest.mark.parametrize("case", ACL_CASES, ids=lambda c: c.name)
def test_golden_graphs_join_their_streams_and_copy_no_input(case):
    checks = read_artifact(GRAPHS, case.name, "acl_checks.json")
    assert checks["join"] == [] and checks["copies"] == []


@pytest.mark.parametrize("case", RINGED, ids=lambda c: c.name)
def test_golden_prefetch_communication_is_on_one_stream(case):
    comm = read_artifact(GRAPHS, case.name, "acl_checks.json")["comm"]
    # every layer's write (a broadcast, or a copy from host memory) per group, on the one prefetch stream
    assert comm["ops_per_stream"]["prefetch"] == case.ring_groups * case.config.num_layers
    # module TP's collectives run on main beside the broadcasts: two communication streams at once
    assert comm["max_concurrent"] == (2 if case.module_tp else 1)
    for budget in comm["budgets"].values():
        assert bool(budget["problems"]) == bool(budget["deadlock_check_pairs"]) == case.module_tp


def test_golden_host_ring_without_its_join_leaves_the_prefetch_stream_open():
    """The ring filled from host memory (L = 3, k = 2) with the event that joins the prefetch stream back to main
    removed (its wait at the end of the graph): ACL capture would fail, and the check names the stream's last op."""
    name = "qwen3-tp1-offload-L3-k2-decode"
    lines = read_artifact(GRAPHS, name, "acl_graph.txt").splitlines(keepends=True)
    (join,) = [i for i, ln in enumerate(lines) if "tagged_event_wait.default](args = (graph_1_scope_exit_2," in ln]
    del lines[join]
    gm = golden.acl_module(name, "".join(lines))
    assert capture_checks.unjoined_streams(golden.acl_module(name)) == []
    assert capture_checks.unjoined_streams(gm) == [
        "join: stream 'prefetch' is not joined to the capture stream before the graph ends: no event recorded after "
        f"its last op broadcast_into_default is waited on 'main' {JOIN_FAILS}"
    ]


def test_golden_control_without_events_copies_the_ring():
    checks = read_artifact(GRAPHS, "qwen3-dp2-layer_shard-k1-decode", "acl_checks_no_events.json")
    assert checks["copies"] and all(RING in p for p in checks["copies"])


@pytest.mark.parametrize("case", ACL_CASES, ids=lambda c: c.name)
def test_golden_communication_gates_exactly_the_plans_the_npu_backends_refuse(case):
    """Two streams communicating at once (npugraph_ex's deadlock_check pairs) in a golden graph happen exactly where
    ``check_comm_streams`` refuses the case's plan on the NPU backends: every plan the NPU compiles passes the rule
    with no pair, and the module-TP case (its o_proj and MLP exchanges on the compute stream beside the ring's
    broadcasts) is the refused counterexample."""
    from functional_npu.core.mesh import Mesh
    from functional_npu.runtime.serving.backends import Backend
    from functional_npu.runtime.serving.compile_policy import check_comm_streams

    budgets = read_artifact(GRAPHS, case.name, "acl_checks.json")["comm"]["budgets"]
    found = {name: (b["problems"], b["deadlock_check_pairs"]) for name, b in budgets.items()}
    try:
        check_comm_streams(case.plan, Mesh.abstract(case.axes, 0), Backend("npugraph_ex", "npu"), "case")
        refused = False
    except ValueError as e:
        assert "may deadlock the device's vector cores under capture" in str(e)
        refused = True
    assert refused == any(p or pairs for p, pairs in found.values()), found
    assert refused == case.module_tp
