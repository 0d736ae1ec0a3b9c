"""ACL graph capture (npugraph_ex): the capture order's hazard check on the golden layer-sharded graphs (recomputed from
their stored text), on graphs built the way npugraph_ex's passes leave the prefetch (with and without events), each
planted fault matched by its exact finding, and the backend's one-line refusal off an NPU. The capture order is a
partial order (one total order per stream, events between them): every claim of the check can fire there."""

from pathlib import Path

import pytest
import torch

from functional_npu.checks import check
from functional_npu.core import collectives  # noqa: F401 - defines functional_npu::broadcast_into
from functional_npu.npu import acl_graph
from functional_npu.runtime.serving.backends import BACKENDS, resolve_backend
from tools.aten_graphs import CASES, read_artifact
from tools.fx_text import parse_fx_text

from ..support import golden, npugraph_ex_ops  # noqa: F401 - defines npugraph_ex's op schemas

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
RINGED = [c for c in CASES if c.ringed]  # the layer-sharded cases and those with series in host memory


# ---- the golden artifacts: every verdict recomputed from the stored graph text ----------------------
def _golden(name: str, text: str | None = None) -> torch.fx.GraphModule:
    """The stored ACL graph of case ``name`` (or ``text``), rebuilt from its text, with its input layout."""
    text = read_artifact(GRAPHS, name, "acl_graph.txt") if text is None else text
    return torch.fx.GraphModule(torch.nn.Module(), parse_fx_text(text, read_artifact(GRAPHS, name, "inputs.json")))


@pytest.mark.parametrize("case", RINGED, ids=lambda c: c.name)
def test_golden_ring_capture_is_safe(case):
    gm = _golden(case.name)
    report = acl_graph.prefetch_report(gm, case.k, phase=case.ring_phase)  # recomputed: the stored JSON is compared
    assert report["problems"] == [] and report["ok"]
    assert report["allocated_prefetch_bytes"] == 0  # the ring is the graph's input: reinplaced, no copy back
    groups, layers = case.ring_groups, case.config.num_layers
    assert report["ring_slots"] == groups * (case.k + 1)
    assert report["broadcasts"] == groups * layers  # a copy from host memory is the same op, a group of one
    assert report["broadcast_streams"] == ["prefetch"]  # one side stream, reused by every layer
    prog, _ = acl_graph.program(acl_graph.capture_order(gm), case.k, phase=case.ring_phase)
    assert sorted({layer for _, layer in prog.reads.values() if layer is not None}) == list(range(layers))
    assert [r for r, (_, layer) in prog.reads.items() if layer is None] == golden.unpinned(case, prog.reads)
    stored = read_artifact(GRAPHS, case.name, "acl_prefetch.json")
    assert {key: stored[key] for key in report if key != "ring_bytes"} == {
        key: value for key, value in report.items() if key != "ring_bytes"
    }
    graph = read_artifact(GRAPHS, case.name, "acl_graph.txt")
    assert "functional_npu.broadcast_into.default" in graph and "auto_functionalized" not in graph
    assert "aten.copy_.default" not in graph  # no epilogue writing the ring back


def _swap_lines(text: str, a: str, b: str) -> str:
    assert a in text and b in text
    return text.replace(a, "\0").replace(b, a).replace("\0", b)


def test_golden_capture_with_two_slot_inputs_swapped_reads_and_writes_the_wrong_layers():
    """The k = 2 graph with the input indices of slots 0 and 1 swapped (their placeholders' places): its data flow is
    as consistent as before, but each slot is bound to its schedule by its index, each read to its layer by the
    compute around it."""
    name = "qwen3-dp2-layer_shard-k2-decode"
    text = read_artifact(GRAPHS, name, "acl_graph.txt")
    swapped = _swap_lines(
        text,
        "    %arg5_1 : [num_users=3] = placeholder[target=arg5_1]\n",
        "    %arg6_1 : [num_users=2] = placeholder[target=arg6_1]\n",
    )
    assert acl_graph.prefetch_report(_golden(name, swapped), 2)["problems"] == [
        "the right layer: broadcast_into_default_2 writes layer 3 into arg5_1 (ring slot 1); layer 3 belongs in ring "
        "slot 0",
        "the right layer: broadcast_into_default_1 writes layer 4 into arg6_1 (ring slot 0); layer 4 belongs in ring "
        "slot 1",
        "the right layer: mm_1 reads layer 0 from arg5_1 (ring slot 1), which holds layer 1 then",
        "the right layer: mm_3 reads layer 0 from arg5_1 (ring slot 1), which holds layer 1 then",
        "the right layer: mm_5 reads layer 1 from arg6_1 (ring slot 0), which holds layer 0 then",
        "the right layer: mm_7 reads layer 1 from arg6_1 (ring slot 0), which holds layer 0 then",
    ]


def test_golden_capture_without_one_issue_event_writes_a_slot_still_read():
    """The k = 1 graph without the event that orders layer 3's broadcast (into slot 1) after the compute entering
    layer 2: on the side stream it is unordered with layer 1's reads of slot 1 (write after read), and it runs
    alongside nothing it must wait for."""
    name = "qwen3-dp2-layer_shard-k1-decode"
    lines = read_artifact(GRAPHS, name, "acl_graph.txt").splitlines(keepends=True)
    waits = [
        i for i, ln in enumerate(lines) if "tagged_event_wait.default](args = (functional_npu.prefetch.issue" in ln
    ]
    del lines[waits[2]]  # the third broadcast's: layer 3's
    problems = acl_graph.prefetch_report(_golden(name, "".join(lines)), 1)["problems"]
    assert problems == [
        "write after read: broadcast_into_default_1 writes arg6_1 unordered with mm_5, which reads it",
        "write after read: broadcast_into_default_1 writes arg6_1 unordered with mm_7, which reads it",
    ]


def test_golden_host_copy_without_its_issue_event_writes_a_slot_still_read():
    """The ring filled from host memory (L = 3, k = 1) without the event that orders layer 2's copy (into slot 0)
    after the compute entering layer 1: on the side stream it is unordered with layer 0's reads of slot 0."""
    name = "qwen3-tp1-offload-L3-k1-decode"
    lines = read_artifact(GRAPHS, name, "acl_graph.txt").splitlines(keepends=True)
    waits = [
        i for i, ln in enumerate(lines) if "tagged_event_wait.default](args = (functional_npu.prefetch.issue" in ln
    ]
    del lines[waits[1]]  # the second copy's: layer 2's
    assert acl_graph.prefetch_report(_golden(name, "".join(lines)), 1)["problems"] == [
        "write after read: broadcast_into_default_1 writes arg5_1 unordered with mm_1, which reads it",
        "write after read: broadcast_into_default_1 writes arg5_1 unordered with mm_3, which reads it",
    ]


def test_golden_control_without_events_fails():
    """Stored verdict (its graph text is not kept): npugraph_ex refuses to reinplace a mutated input used across
    streams without events, so the slots are cloned."""
    report = read_artifact(GRAPHS, "qwen3-dp2-layer_shard-k1-decode", "acl_prefetch_no_events.json")
    assert not report["ok"]
    assert report["allocated_prefetch_bytes"] > 0
    assert report["problems"][-1] == "bound: 4 slots used, the ring has 2"


def test_golden_streams_name_one_side_stream():
    streams = read_artifact(GRAPHS, "qwen3-dp2-layer_shard-k2-decode", "acl_streams.json")
    assert set(streams["streams"]) == {"main", "prefetch"}
    assert streams["labels"] == ["prefetch"]
    assert not streams["unmatched"]
    assert acl_graph.streams_summary(_golden("qwen3-dp2-layer_shard-k2-decode")) | {"labels": ["prefetch"]} == streams


# ---- graphs built the way npugraph_ex leaves the prefetch -----------------------------------------
def _graph(
    k: int,
    layers: int,
    *,
    events: bool = True,
    shift: int = 0,
    ungated: tuple[int, ...] = (),
    stream_of: dict[int, str] | None = None,
) -> torch.fx.GraphModule:
    """The decoder's layer loop as npugraph_ex captures it: per layer ``i``, the broadcast of layer ``i + k`` into slot
    ``(i + k) mod (k + 1)`` on the ``prefetch`` stream (``stream_of``: another, for some layers), then the wait and
    the read of layer ``i``'s slot on main, used with layer ``i``'s own norm. The slots are ``state.prefetched`` and
    the norms ``params.layers.{i}.norm`` (the input layout); ``shift``: the slot index computed wrongly; ``ungated``:
    the layers whose broadcast waits for no event."""
    g = torch.fx.Graph()
    slots = [g.placeholder(f"slot{s}") for s in range(k + 1)]
    for s, node in enumerate(slots):
        node.meta |= {"val": torch.empty(16, device="meta"), "input_path": f"state.prefetched.{s}"}
    norms = [g.placeholder(f"norm{i}") for i in range(layers)]
    for i, node in enumerate(norms):
        node.meta["input_path"] = f"params.layers.{i}.norm"
    x = g.placeholder("x")
    ops = torch.ops
    for i in range(layers):
        v = i + k + shift  # shift: the slot index computed wrongly
        gated = events and i not in ungated
        if gated:
            g.call_function(ops.npugraph_ex.tagged_event_record.default, ("fnpu.issue", True))
        label = (stream_of or {}).get(i, "prefetch")
        g.call_function(ops.npugraph_ex.scope_enter.default, (["_user_stream_label"], [label]))
        if gated:
            g.call_function(ops.npugraph_ex.tagged_event_wait.default, ("fnpu.issue", True))
        g.call_function(ops.functional_npu.broadcast_into.default, (slots[v % (k + 1)], [], x, 1, "0", 2))
        if events:
            g.call_function(ops.npugraph_ex.tagged_event_record.default, (f"fnpu.slot{v % (k + 1)}", True))
        g.call_function(ops.npugraph_ex.scope_exit.default, ())
        if events and i >= k:
            g.call_function(ops.npugraph_ex.tagged_event_wait.default, (f"fnpu.slot{i % (k + 1)}", True))
        w = g.call_function(ops._c10d_functional.wait_tensor.default, (slots[i % (k + 1)],))
        r = g.call_function(ops.aten.mul.Tensor, (w, norms[i]))
        x = g.call_function(ops.aten.add.Tensor, (x, r))
    g.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("k,layers", [(k, n) for k in (0, 1, 2) for n in (1, 3, 4, 7) if k < n])
def test_synthetic_capture_with_events_is_safe(k, layers):
    report = acl_graph.prefetch_report(_graph(k, layers), k)
    assert report["ok"], report["problems"]
    assert report["broadcast_streams"] == ["prefetch"]
    prog, _ = acl_graph.program(acl_graph.capture_order(_graph(k, layers)), k)
    assert [layer for _, layer in prog.reads.values()] == list(range(layers))  # each read's layer, from its norm


@pytest.mark.parametrize("k", [0, 1, 2])
def test_synthetic_capture_without_events_fails(k):
    """Nothing orders a broadcast on the side stream with the reads on main: every write races every read of its
    slot."""
    problems = acl_graph.prefetch_report(_graph(k, 4, events=False), k)["problems"]
    mul = {i: "mul_tensor" if i == 0 else f"mul_tensor_{i}" for i in range(4)}
    assert problems == [
        f"write after read: broadcast_into_default{'' if v == k else f'_{v - k}'} writes slot{v % (k + 1)} unordered "
        f"with {mul[i]}, which reads it"
        for i in range(4)
        for v in range(k, 4 + k)
        if v % (k + 1) == i % (k + 1)
    ]


def test_a_broadcast_without_its_issue_event_writes_a_slot_still_read():
    """Partial order (streams and events): layer 3's broadcast (slot 1 of 2) without the event ordering it after the
    compute entering layer 2 races layer 1's read of slot 1."""
    problems = acl_graph.prefetch_report(_graph(1, 4, ungated=(2,)), 1)["problems"]
    assert problems == [
        "write after read: broadcast_into_default_2 writes slot1 unordered with mul_tensor_1, which reads it"
    ]


def test_two_broadcasts_into_one_slot_on_two_streams_are_unordered():
    """Partial order: layer 3's broadcast on a second side stream, with no event, is unordered with layer 1's
    broadcast into the same slot (write after write) and with layer 1's read of it (write after read)."""
    problems = acl_graph.prefetch_report(_graph(1, 4, ungated=(2,), stream_of={2: "prefetch2"}), 1)["problems"]
    assert problems == [
        "write after write: broadcast_into_default and broadcast_into_default_2 write slot1 unordered",
        "write after read: broadcast_into_default_2 writes slot1 unordered with mul_tensor_1, which reads it",
        "streams: the broadcasts run on ['prefetch', 'prefetch2'], not one side stream",
    ]


def test_capture_order_streams_and_events():
    order = acl_graph.capture_order(_graph(1, 3))
    writes = [op for op, node in order.nodes.items() if "broadcast_into" in str(node.target)]
    assert {order.stream[w] for w in writes} == {"prefetch"}
    assert [t for _, _, t in order.events].count("fnpu.issue") == 3
    prog, found = acl_graph.program(order, 1)
    assert found["allocs"] == {} and len(found["slots"]) == 2
    assert prog.slot_index == {"slot0": 0, "slot1": 1} and prog.initial == {"slot0": 0}
    assert check(prog, 1, slots=2) == []


def test_a_wrong_slot_index_reads_the_wrong_layer():
    """Every broadcast one slot off (layer v into slot v + 1 mod 2): each write is in the wrong slot, each read of layer
    i (its norm's) finds layer i + 1, and the first broadcast lands in the slot of the carried layer 0 while it is
    read (the overlap and concurrency findings follow: each broadcast now feeds the very next layer)."""
    problems = acl_graph.prefetch_report(_graph(1, 3, shift=1), 1)["problems"]
    assert problems == [
        "the right layer: broadcast_into_default writes layer 1 into slot0 (ring slot 0); layer 1 belongs in ring "
        "slot 1",
        "the right layer: broadcast_into_default_1 writes layer 2 into slot1 (ring slot 1); layer 2 belongs in ring "
        "slot 0",
        "the right layer: broadcast_into_default_2 writes layer 3 into slot0 (ring slot 0); layer 3 belongs in ring "
        "slot 1",
        "write after read: broadcast_into_default writes slot0 unordered with mul_tensor, which reads it",
        "the right layer: mul_tensor_1 reads layer 1 from slot1 (ring slot 1), which holds layer 2 then",
        "the right layer: mul_tensor_2 reads layer 2 from slot0 (ring slot 0), which holds layer 3 then",
        *[
            f"overlap: broadcast_into_default_{w} (layer {w + 1}) is waited on before any earlier layer's reads can "
            "run alongside it"
            for w in (1, 2)
        ],
        "concurrency: broadcast_into_default_1 (layer 2) is ordered with every read of every earlier layer",
        "concurrency: broadcast_into_default_2 (layer 3) is ordered with every read of every earlier layer",
    ]


def test_slot_one_too_few_is_a_bound_violation():
    """A ring of 3 slots checked as k = 1 (2 slots): the bound, then every write and read against the 2-slot schedule
    (slot 2 is past the ring; slot 1 holds nothing carried at k = 1)."""
    problems = acl_graph.prefetch_report(_graph(2, 5), 1)["problems"]
    assert problems == [
        "bound: 3 slots used, the ring has 2",
        *[
            f"the right layer: broadcast_into_default{w} writes layer {v} into slot{s} (ring slot {s}); layer {v} "
            f"belongs in ring slot {v % 2}"
            for w, v, s in (("", 1, 2), ("_3", 4, 2), ("_4", 5, 0))
        ],
        "the right layer: mul_tensor_1 reads layer 1 from slot1 (ring slot 1), which holds no layer of this step then",
        "the right layer: mul_tensor_2 reads layer 2 from slot2 (ring slot 2), which holds layer 1 then",
        "the right layer: mul_tensor_3 reads layer 3 from slot0 (ring slot 0), which holds layer 2 then",
        "the right layer: mul_tensor_4 reads layer 4 from slot1 (ring slot 1), which holds layer 3 then",
    ]


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
