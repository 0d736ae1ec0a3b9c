"""Reading GE graphs: census, Hcom schedule, the partial order's refusals, and the prefetch ring's
hazard check on graphs built the way torchair converts the layer-sharded decoder's ring (with and without
``after``, with an allocated buffer, with a ring too small or indexed wrongly)."""

import itertools

import pytest

from functional_npu.npu.ge_graph import census, group_ranks, hcom_schedule, ring_check, ring_program

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
    ``k + 1``), layers 0 .. k-1 carried in slot ``v % slots``; per layer i the write of layer v = i + k into
    ``slot(v)`` (default ``v % slots``): on its owner (v % dp == 0) ViewCopy into the slot, then HcomBroadcast of
    it, each with a control edge on x_i (``after=False``: none), then layer i's read (Identity wait -> SplitV ->
    MatMul) of the value layer i was written as. ``alloc``: the broadcast's buffer is a Fill (the old design)."""
    slots = k + 1 if slots is None else slots
    slot = slot or (lambda v: v % slots)
    ops = [op("tokens", "Data"), op("x0", "Add", ["tokens"])]
    value = {s: f"ring{s}" for s in range(slots)}
    ops += [op(f"ring{s}", "RefData", shape=(48,)) for s in range(slots)]
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
            op(f"mm{i}", "MatMul", [f"x{i}", f"split{i}"]),
            op(f"x{i + 1}", "Add", [f"x{i}", f"mm{i}"]),
        ]
    ops.append(op("out", "NetOutput", [f"x{layers}"] + [value[s] for s in range(slots)]))
    return ops


@pytest.mark.parametrize("layers,k", [(2, 0), (4, 0), (4, 1), (4, 2), (6, 3), (5, 1), (7, 2)])
def test_a_hinted_ring_passes_the_hazard_check(layers, k):
    found = ring_check(ring_graph(layers, k), k=k, num_layers=layers, axis_size=2)
    assert found["ok"], found["problems"]
    assert found["ring_slots"] == k + 1 and found["ring_bytes"] == (k + 1) * 48 * 4
    assert found["allocated_prefetch_bytes"] == 0 and found["broadcasts_count"] == layers
    assert [r["layer"] for r in found["broadcasts"]] == list(range(k, layers + k))
    program, _ = ring_program(ring_graph(layers, k), k=k)
    assert len(program.writes) == layers + len([v for v in range(k, layers + k) if v % 2 == 0])  # + owner's copies


def test_without_after_a_write_overtakes_the_reads_of_its_slot():
    found = ring_check(ring_graph(4, 1, after=False), k=1, num_layers=4, axis_size=2)
    assert not found["ok"]
    assert any(v.startswith("write after read: bcast2 writes ring0") for v in found["violations"])
    assert any("runs on stream None" in p for p in found["problems"])


def test_an_ungated_allocation_is_reported():
    found = ring_check(ring_graph(4, 1, alloc=True), k=1, num_layers=4, axis_size=2)
    assert not found["ok"] and found["allocated_prefetch_bytes"] == 4 * 48 * 4
    assert sum(v.startswith("alloc: fill") for v in found["violations"]) == 4


def test_a_ring_one_slot_too_small_is_a_write_after_read():
    found = ring_check(ring_graph(4, 1, slots=1), k=1, num_layers=4, axis_size=2)
    assert any(v.startswith("write after read: bcast1 writes ring0") for v in found["violations"])


def test_an_unturned_ring_when_l_is_not_a_multiple_of_k_plus_1_is_a_write_after_read():
    """L = 3, k = 1: the next step's layer 0 (v = 3) numbered 0 mod 2 without the turn lands in slot 0, which holds
    layer 2, being read (vLLM's issue 54975: the bug class of a step not a multiple of the ring)."""
    layers, k = 3, 1
    wrong = ring_check(
        ring_graph(layers, k, slot=lambda v: (v - layers if v >= layers else v) % (k + 1)),
        k=k,
        num_layers=layers,
        axis_size=2,
    )
    assert any(v.startswith("write after read: bcast3 writes ring0") for v in wrong["violations"])
    assert ring_check(ring_graph(layers, k), k=k, num_layers=layers, axis_size=2)["ok"]


def test_a_broadcast_on_the_compute_stream_or_from_the_wrong_root_is_named():
    found = ring_check(ring_graph(4, 1, stream="compute"), k=1, num_layers=4, axis_size=2)
    assert any("runs on stream 'compute', not 'prefetch'" in p for p in found["problems"])
    found = ring_check(ring_graph(4, 1, dp=1), k=1, num_layers=4, axis_size=2)
    assert any("broadcasts from 0" in p for p in found["problems"])


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
