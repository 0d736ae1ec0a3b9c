"""Reading GE graphs: census, Hcom schedule, the partial order's refusals, and the prefetch ring's
hazard check on graphs built the way torchair converts the layer-sharded decoder's ring (with and without
``after``, with an allocated buffer, with a ring too small or indexed wrongly), and on the stored golden graphs,
read back from their text (their verdicts recomputed, and faults planted in them). A GE graph is a partial order:
every claim of the check can fire there, and each planted fault is matched by its exact findings."""

import itertools

import pytest

from functional_npu.npu import ge_graph
from functional_npu.npu.ge_graph import census, group_ranks, hcom_schedule, parse_pbtxt, ring_check, ring_program
from tools.aten_graphs import CASES, read_artifact

from ..support import GRAPHS, golden

WAIT = "wait_tensor_0-_c10d_functional.wait_tensor.default.OUTPUT.0"


def op(name, type_, inputs=(), controls=(), stream=None, attrs=None, out_fx="", shape=(4, 4)):
    desc = {"dtype": "DT_FLOAT", "shape": list(shape), "fx": out_fx}
    return {
        "name": name,
        "type": type_,
        "inputs": list(inputs),
        "controls": list(controls),
        "stream": stream,
        "attrs": attrs or {},
        "in": [desc] if inputs else [],
        "out": [desc],
    }


def test_a_graph_with_a_cycle_or_an_unknown_input_is_refused():
    with pytest.raises(ValueError, match="cycle"):
        ring_program([op("a", "Op", ["b"]), op("b", "Op", ["a"])], k=1)
    with pytest.raises(ValueError, match="ghost"):
        ring_program([op("a", "Op", ["ghost"])], k=1)
    # control edges order as data edges do: c after b after a, whatever the listed order
    program, _ = ring_program([op("c", "Op", ["b"]), op("b", "Op", [], ["a"]), op("a", "Op")], k=1)
    assert list(program.ops) == ["a", "b", "c"]


# ---- the prefetch ring's hazard check on torchair-shaped graphs --------------------------------------
def ring_graph(layers, k, *, slots=None, after=True, stream="prefetch", alloc=False, slot=None, dp=2):
    """One decode step as torchair converts the ring (``ge_converters``): ``slots`` RefData inputs (default
    ``k + 1``, input indices 1 ..), layers 0 .. k-1 carried in slot ``v % slots``, then one Data input per layer (its
    norm); per layer i the write of layer v = i + k into ``slot(v)`` (default ``v % slots``): on its owner
    (v % dp == 0) ViewCopy into the slot, then HcomBroadcast of it, each with a control edge on x_i (``after=False``:
    none), then layer i's read (Identity wait -> SplitV -> MatMul) of the value layer i was written as, used with
    layer i's norm. ``alloc``: the broadcast's buffer is a Fill (the old design). :func:`layout` is its input
    layout."""
    slots = k + 1 if slots is None else slots
    slot = slot or (lambda v: v % slots)
    ops = [op("tokens", "Data", attrs={"index": 0}), op("x0", "Add", ["tokens"])]
    value = {s: f"ring{s}" for s in range(slots)}
    ops += [op(f"ring{s}", "RefData", attrs={"index": 1 + s}, shape=(48,)) for s in range(slots)]
    ops += [op(f"norm{i}", "Data", attrs={"index": 1 + slots + i}) for i in range(layers)]
    layer_value = {v: value[slot(v)] for v in range(k)}
    for i in range(layers):
        v, s = i + k, slot(i + k)
        ctl = [f"x{i}"] if after else []
        st = stream if after else None
        if alloc:
            ops += [op(f"fill{v}", "Fill", shape=(48,)), op(f"edge{v}", "Identity", [f"fill{v}"], ctl, st)]
            buf = f"edge{v}"
        else:
            buf = value[s]
            if v % dp == 0:
                ops.append(op(f"copy{v}", "ViewCopy", [buf], ctl, st, shape=(48,)))
                buf = f"copy{v}"
        ops.append(
            op(
                f"bcast{v}",
                "HcomBroadcast",
                [buf],
                ctl,
                st,
                attrs={"group": "tag=ptd:0;rank_list=0,1", "root_rank": v % layers % dp},
                out_fx=WAIT,
                shape=(48,),
            )
        )
        if not alloc:
            value[s] = f"bcast{v}"
        layer_value[v] = f"bcast{v}"
        ops += [
            op(f"w{i}", "Identity", [layer_value[i]], out_fx=WAIT),
            op(f"split{i}", "SplitV", [f"w{i}"]),
            op(f"mm{i}", "MatMul", [f"x{i}", f"split{i}", f"norm{i}"]),
            op(f"x{i + 1}", "Add", [f"x{i}", f"mm{i}"]),
        ]
    ops.append(op("out", "NetOutput", [f"x{layers}"] + [value[s] for s in range(slots)]))
    return ops


def layout(ops):
    """The input layout of a :func:`ring_graph`: each input's path, by its index."""
    paths = {}
    for o in ops:
        if o["type"] in ("Data", "RefData"):
            name = o["name"]
            path = f"state.prefetched.{name[4:]}" if name.startswith("ring") else f"params.layers.{name[4:]}.norm"
            paths[o["attrs"]["index"]] = "tokens" if name == "tokens" else path
    return [paths[i] for i in range(len(paths))]


def checked(ops, k, layers, **kwargs):
    return ring_check(ops, k=k, num_layers=layers, axis_size=2, inputs=layout(ops), **kwargs)


@pytest.mark.parametrize("layers,k", [(2, 0), (4, 0), (4, 1), (4, 2), (6, 3), (5, 1), (7, 2)])
def test_a_hinted_ring_passes_the_hazard_check(layers, k):
    found = checked(ring_graph(layers, k), k, layers)
    assert found["ok"], found["problems"]
    assert found["ring_slots"] == k + 1 and found["ring_bytes"] == (k + 1) * 48 * 4
    assert found["allocated_prefetch_bytes"] == 0 and found["broadcasts_count"] == layers
    assert [r["layer"] for r in found["broadcasts"]] == list(range(k, layers + k))
    program, _ = ring_program(ring_graph(layers, k), k=k, inputs=layout(ring_graph(layers, k)))
    assert len(program.writes) == layers + len([v for v in range(k, layers + k) if v % 2 == 0])  # + owner's copies
    assert program.reads == {
        f"mm{i}": (f"ring{i % (k + 1)}", i) for i in range(layers)
    }  # each read's layer: its norm's
    assert program.slot_index == {f"ring{s}": s for s in range(k + 1)}


def test_without_after_a_write_overtakes_the_reads_of_its_slot():
    """Partial order: no control edge gates a write, so each races every read of its slot before its own layer's."""
    found = checked(ring_graph(4, 1, after=False), 1, 4)
    assert found["violations"] == [
        "write after read: copy2 writes ring0 unordered with mm0, which reads it",
        "write after read: bcast2 writes ring0 unordered with mm0, which reads it",
        "write after read: copy4 writes ring0 unordered with mm0, which reads it",
        "write after read: bcast4 writes ring0 unordered with mm0, which reads it",
        "write after read: bcast3 writes ring1 unordered with mm1, which reads it",
        "write after read: copy4 writes ring0 unordered with mm2, which reads it",
        "write after read: bcast4 writes ring0 unordered with mm2, which reads it",
    ]
    assert found["problems"][len(found["violations"]) :] == [
        f"bcast{v} (layer {v}) runs on stream None, not 'prefetch'" for v in range(1, 5)
    ]


def test_two_writes_into_one_slot_unordered_are_write_after_write():
    """Partial order: layer 4's broadcast into slot 0 taking the slot's input value (not layer 2's write's) and not
    gated: it is unordered with layer 2's broadcast, the write before it (write after write), and with layer 0's
    and 2's reads."""
    ops = ring_graph(4, 1)
    for o in ops:
        if o["name"] == "copy4":
            o["inputs"], o["controls"] = ["ring0"], []
        if o["name"] == "bcast4":
            o["controls"] = []
    assert checked(ops, 1, 4)["violations"] == [
        "write after write: bcast2 and copy4 write ring0 unordered",
        "write after read: copy4 writes ring0 unordered with mm0, which reads it",
        "write after read: bcast4 writes ring0 unordered with mm0, which reads it",
        "write after read: copy4 writes ring0 unordered with mm2, which reads it",
        "write after read: bcast4 writes ring0 unordered with mm2, which reads it",
    ]


def test_an_ungated_allocation_is_reported():
    found = checked(ring_graph(4, 1, alloc=True), 1, 4)
    assert not found["ok"] and found["allocated_prefetch_bytes"] == 4 * 48 * 4
    assert found["violations"] == [
        f"alloc: fill{v} allocates a 192-byte prefetch buffer inside the graph" for v in range(1, 5)
    ]


def test_a_ring_one_slot_too_small_is_a_write_after_read():
    """k = 1 over one slot: each layer is written into the slot the layer before is still read from (and layers 1
    and 3 land in slot 0, which they do not belong in)."""
    found = checked(ring_graph(4, 1, slots=1), 1, 4)
    assert found["violations"] == [
        "the right layer: bcast1 writes layer 1 into ring0 (ring slot 0); layer 1 belongs in ring slot 1",
        "the right layer: bcast3 writes layer 3 into ring0 (ring slot 0); layer 3 belongs in ring slot 1",
        "write after read: bcast1 writes ring0 unordered with mm0, which reads it",
        "write after read: copy2 writes ring0 unordered with mm1, which reads it",
        "write after read: bcast2 writes ring0 unordered with mm1, which reads it",
        "write after read: bcast3 writes ring0 unordered with mm2, which reads it",
        "write after read: copy4 writes ring0 unordered with mm3, which reads it",
        "write after read: bcast4 writes ring0 unordered with mm3, which reads it",
    ]


def test_an_unturned_ring_when_l_is_not_a_multiple_of_k_plus_1_is_a_write_after_read():
    """L = 3, k = 1: the next step's layer 0 (v = 3) numbered 0 mod 2 without the turn lands in slot 0, which holds
    layer 2, being read (vLLM's issue 54975: the bug class of a step not a multiple of the ring)."""
    layers, k = 3, 1
    wrong = checked(ring_graph(layers, k, slot=lambda v: (v - layers if v >= layers else v) % (k + 1)), k, layers)
    assert wrong["violations"] == [
        "the right layer: bcast3 writes layer 3 into ring0 (ring slot 0); layer 3 belongs in ring slot 1",
        "write after read: bcast3 writes ring0 unordered with mm2, which reads it",
    ]
    assert checked(ring_graph(layers, k), k, layers)["ok"]


def test_slot_inputs_swapped_are_the_wrong_layers():
    """The same graph with the input indices of its two slots swapped: each write lands in, and each read finds, the
    other slot's layers. Without the layout the reads name no layer: the writes still fail."""
    ops = ring_graph(4, 1)
    for o in ops:
        if o["name"] in ("ring0", "ring1"):
            o["attrs"]["index"] = 3 - o["attrs"]["index"]
    wrong = [
        "the right layer: bcast1 writes layer 1 into ring1 (ring slot 0); layer 1 belongs in ring slot 1",
        "the right layer: copy2 writes layer 2 into ring0 (ring slot 1); layer 2 belongs in ring slot 0",
        "the right layer: bcast2 writes layer 2 into ring0 (ring slot 1); layer 2 belongs in ring slot 0",
        "the right layer: bcast3 writes layer 3 into ring1 (ring slot 0); layer 3 belongs in ring slot 1",
        "the right layer: copy4 writes layer 4 into ring0 (ring slot 1); layer 4 belongs in ring slot 0",
        "the right layer: bcast4 writes layer 4 into ring0 (ring slot 1); layer 4 belongs in ring slot 0",
    ]
    found = ring_check(ops, k=1, num_layers=4, axis_size=2, inputs=layout(ring_graph(4, 1)))
    assert found["violations"] == wrong + [
        "the right layer: mm0 reads layer 0 from ring0 (ring slot 1), which holds no layer of this step then"
    ]
    assert ring_check(ops, k=1, num_layers=4, axis_size=2)["violations"] == wrong


def test_a_broadcast_on_the_compute_stream_or_from_the_wrong_root_is_named():
    found = checked(ring_graph(4, 1, stream="compute"), 1, 4)
    assert found["problems"] == [f"bcast{v} (layer {v}) runs on stream 'compute', not 'prefetch'" for v in range(1, 5)]
    found = checked(ring_graph(4, 1, dp=1), 1, 4)
    assert found["problems"] == ["bcast1 (layer 1) broadcasts from 0", "bcast3 (layer 3) broadcasts from 0"]


def test_hcom_schedule_and_census():
    ops = ring_graph(2, 1)
    assert group_ranks("tag=ptd:3;rank_list=0,2,4") == [0, 2, 4]
    schedule = hcom_schedule(ops, {(0, 1): "dp"})
    assert len(schedule) == 2 and schedule[0] == {
        "op": "HcomBroadcast",
        "axis": "dp",
        "ranks": [0, 1],
        "bytes": 192,
        "root": 1,
        "stream": "prefetch",
    }
    assert census(ops)["HcomBroadcast"] == 2
    assert list(itertools.islice(census(ops), 2)) == ["Add", "Data"]  # sorted by type


# ---- the golden GE graphs: every verdict recomputed from the stored graph text -------------------------
RINGED = [c for c in CASES if c.ringed]  # the layer-sharded cases and those with series in host memory


@pytest.mark.parametrize("case", RINGED, ids=lambda c: c.name)
def test_golden_ge_graph_keeps_the_ring_safe(case):
    """Read from the stored GE graph's partial order (no torchair): nothing found, each read's layer known from the
    graph's own per-layer inputs; the JSON stored beside it says the same; the graph's census and Hcom schedule,
    read back from its text, are the stored ones. A copy from host memory is a write of its own (no root)."""
    found = golden.ge_ring_check(case)
    assert found["ok"] and found["problems"] == [], found["problems"]
    groups, layers = case.ring_groups, case.config.num_layers
    assert found["ring_slots"] == groups * (case.k + 1) and found["allocated_prefetch_bytes"] == 0
    assert found["broadcasts_count"] == groups * layers
    hosted = [r["layer"] for r in found["broadcasts"] if r.get("source") == "host"]
    assert hosted == (list(range(case.k, case.k + layers)) if case.offload else [])
    program, _ = ring_program(
        golden.ge_ops(case.name), k=case.k, series=groups, inputs=golden.inputs(case.name), phase=case.ring_phase
    )
    assert sorted({layer for _, layer in program.reads.values() if layer is not None}) == list(range(layers))
    assert [r for r, (_, layer) in program.reads.items() if layer is None] == golden.unpinned(case, program.reads)
    assert read_artifact(GRAPHS, case.name, "ge_prefetch.json") == found
    ops = golden.ge_ops(case.name)
    assert census(ops) == read_artifact(GRAPHS, case.name, "ge_census.json")
    hcom = read_artifact(GRAPHS, case.name, "ge_hcom.json")
    assert hcom_schedule(ops, {tuple(h["ranks"]): h["axis"] for h in hcom}) == hcom


def test_golden_ge_graph_with_two_slot_inputs_swapped_reads_and_writes_the_wrong_layers():
    """The k = 2 graph with the input indices of slots 0 and 1 (RefData_arg5_1, RefData_arg6_1) swapped: its data
    flow is as consistent as before, but each slot is bound to its schedule by its index and each read to its layer
    by the compute around it. (Before the binding, this graph passed.)"""
    case = next(c for c in RINGED if c.name == "qwen3-dp2-layer_shard-k2-decode")
    text = read_artifact(GRAPHS, case.name, "ge_graph.pbtxt.gz")
    swapped = golden.ge_with_index(golden.ge_with_index(text, "RefData_arg5_1", 6), "RefData_arg6_1", 5)
    assert golden.ge_ring_check(case, swapped)["problems"] == [
        "the right layer: HcomBroadcast_1 writes layer 3 into RefData_arg5_1 (ring slot 1); layer 3 belongs in ring "
        "slot 0",
        "the right layer: ViewCopy_2 writes layer 4 into RefData_arg6_1 (ring slot 0); layer 4 belongs in ring slot 1",
        "the right layer: ViewCopy_3 writes layer 4 into RefData_arg6_1 (ring slot 0); layer 4 belongs in ring slot 1",
        "the right layer: HcomBroadcast_2 writes layer 4 into RefData_arg6_1 (ring slot 0); layer 4 belongs in ring "
        "slot 1",
        "the right layer: MatMul_1 reads layer 0 from RefData_arg5_1 (ring slot 1), which holds layer 1 then",
        "the right layer: MatMul_3 reads layer 0 from RefData_arg5_1 (ring slot 1), which holds layer 1 then",
        "the right layer: MatMul_5 reads layer 1 from RefData_arg6_1 (ring slot 0), which holds layer 0 then",
        "the right layer: MatMul_7 reads layer 1 from RefData_arg6_1 (ring slot 0), which holds layer 0 then",
    ]


def _without(text: str, op: str, line: str) -> str:
    """A GE graph's text with ``line`` removed from op ``op``'s block (or replaced: ``line`` as ``old -> new``)."""
    start = text.index(f'  name: "{op}"\n')
    end = text.index("\nop {", start)
    old, _, new = line.partition(" -> ")
    block = text[start:end]
    assert old in block, (op, old)
    return text[:start] + block.replace(old, new, 1) + text[end:]


def test_golden_ge_graph_without_a_gate_writes_a_slot_still_read():
    """Partial order: the k = 1 graph without the control edge that gates layer 3's broadcast (HcomBroadcast_2, into
    RefData_arg6_1) after the compute entering layer 2 races layer 1's reads of that slot."""
    case = next(c for c in RINGED if c.name == "qwen3-dp2-layer_shard-k1-decode")
    text = _without(read_artifact(GRAPHS, case.name, "ge_graph.pbtxt.gz"), "HcomBroadcast_2", '  input: "Add_15:-1"\n')
    assert golden.ge_ring_check(case, text)["problems"] == [
        "write after read: HcomBroadcast_2 writes RefData_arg6_1 unordered with MatMul_5, which reads it",
        "write after read: HcomBroadcast_2 writes RefData_arg6_1 unordered with MatMul_7, which reads it",
    ]


def test_golden_ge_graph_with_two_writes_of_a_slot_unordered_is_write_after_write():
    """Partial order: the same broadcast ungated and taking the slot's input value instead of layer 1's write's: the
    two writes of RefData_arg6_1 are unordered (write after write), and the second races layer 1's reads."""
    case = next(c for c in RINGED if c.name == "qwen3-dp2-layer_shard-k1-decode")
    text = _without(read_artifact(GRAPHS, case.name, "ge_graph.pbtxt.gz"), "HcomBroadcast_2", '  input: "Add_15:-1"\n')
    text = _without(text, "HcomBroadcast_2", 'input: "HcomBroadcast:0" -> input: "RefData_arg6_1:0"')
    assert golden.ge_ring_check(case, text)["problems"] == [
        "write after write: HcomBroadcast and HcomBroadcast_2 write RefData_arg6_1 unordered",
        "write after read: HcomBroadcast_2 writes RefData_arg6_1 unordered with MatMul_5, which reads it",
        "write after read: HcomBroadcast_2 writes RefData_arg6_1 unordered with MatMul_7, which reads it",
    ]


def test_golden_ge_host_copy_without_its_gate_writes_a_slot_still_read():
    """Partial order, the ring filled from host memory (L = 3, k = 1): layer 2's copy into slot 0 (ViewCopy_2, its
    first part, into RefData_arg5_1) without the control edge that gates it after the compute entering layer 1 races
    layer 0's reads of that slot."""
    case = next(c for c in RINGED if c.name == "qwen3-tp1-offload-L3-k1-decode")
    text = _without(read_artifact(GRAPHS, case.name, "ge_graph.pbtxt.gz"), "ViewCopy_2", '  input: "Add_7:-1"\n')
    assert golden.ge_ring_check(case, text)["problems"] == [
        "write after read: ViewCopy_2 writes RefData_arg5_1 unordered with MatMul_1, which reads it",
        "write after read: ViewCopy_2 writes RefData_arg5_1 unordered with MatMul_3, which reads it",
    ]


def test_the_text_parser_reads_protobuf_text_format():
    msg = parse_pbtxt('name: "g" op { name: "a" attr { key: "s" value { s: "x\\"y\\303\\251" } } } op { name: "b" }')
    assert msg == {
        "name": ["g"],
        "op": [{"name": ["a"], "attr": [{"key": ["s"], "value": [{"s": ['x"yé']}]}]}, {"name": ["b"]}],
    }
    assert parse_pbtxt("i: -3 f: 1.5 e: DT_FLOAT") == {"i": [-3], "f": [1.5], "e": ["DT_FLOAT"]}


# ---- a paged cache's writes ------------------------------------------------------------------------------------------
def _write(var_type: str) -> list[dict]:
    """A pool input, a view of it (or a TensorMove copy), ScatterNdUpdate into that."""
    op = lambda name, type, *inputs: {"name": name, "type": type, "inputs": list(inputs)}  # noqa: E731
    return [
        op("RefData_pool", "RefData"),
        op("var", var_type, "RefData_pool"),
        op("idx", "Pack"),
        op("ScatterNdUpdate", "ScatterNdUpdate", "var", "idx", "x"),
        op("x", "Data"),
    ]


def test_a_pool_written_in_place_passes_and_one_written_through_a_copy_is_named():
    assert ge_graph.cache_writes(_write("Identity")) == {"in_place": ["RefData_pool"], "copied": [], "problems": []}
    copied = ge_graph.cache_writes(_write("TensorMove"))
    assert copied["problems"] == [
        "ScatterNdUpdate writes TensorMove var: the pool is copied before the write (not in place on its RefData input)"
    ]
    assert ge_graph.cache_writes([])["problems"] == [
        "no ScatterNdUpdate: the paged cache is not written through its block table"
    ]


@pytest.mark.parametrize("case", [c for c in CASES if c.paged], ids=lambda c: c.name)
def test_golden_paged_steps_write_every_pool_in_place(case):
    """Each layer's pools (k and v, or MLA's latent and rope keys) written in place by ScatterNdUpdate on their RefData
    inputs, as torch-npu's npu_scatter_nd_update_ is converted: no copy of a pool."""
    writes = read_artifact(GRAPHS, case.name, "ge_cache_writes.json")
    assert writes["problems"] == [] and writes["copied"] == []
    assert len(set(writes["in_place"])) == len(writes["in_place"]) == 2 * case.config.num_layers
