"""The prefetch ring: bounded by construction, and every slot access safely ordered.

The positive cases run the real :func:`functional_npu.parallel.prefetch.layer_weights` over two steps under a
dispatch-mode recorder (the broadcasts are recorded, not sent; the order is what is checked); the negative cases
are programs made by :func:`_simulate`, a schedule written here independently of the library, or recorded runs
reordered, with the one thing wrong that the check must find, each matched by its exact message. A recorded run is
a total order: no two accesses are unordered, so write after read and write after write cannot fire there; a write
moved before a read of its slot shows as the right layer read and a read before its wait.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu import Plan
from functional_npu.checks import (
    Program,
    Recorder,
    bind,
    check,
    expected_slot,
    input_layout,
    input_path,
    read_layers,
)
from functional_npu.parallel import prefetch
from functional_npu.parallel.layer_shard import LayerShard, owned_layers
from functional_npu.parallel.prefetch_ring import RingPhase, coalesced, ring_of


class _AxisMesh:
    """One rank of an ``n``-rank ``dp`` axis; the recorder stands in for the process group."""

    def __init__(self, n: int, me: int) -> None:
        self.n, self.me = n, me

    def axis_size(self, axis: str) -> int:
        return self.n

    def axis_index(self, axis: str) -> int:
        return self.me

    def group_name(self, axis: str) -> str:
        return "recorded"


_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


def _params(L: int, n: int, me: int, series: int) -> dict:
    """``series`` layer-sharded leaves (of up to three dtypes, so up to three coalesced groups) over ``dp``."""
    owned = owned_layers(L, n, me)
    stacked = {f"s{j}": torch.full((len(owned), 2 + j, 3), 1, dtype=_DTYPES[j % len(_DTYPES)]) for j in range(series)}
    return {"layers": [{"norm": torch.ones(3)} for _ in range(L)], "series": stacked}


def _plan(params: dict) -> Plan:
    return Plan(layer_shard=LayerShard("dp", tuple(params["series"])))


def _run(L: int, n: int, me: int, k: int, series: int, steps: int = 2, turn: bool = True):
    """Record ``steps`` decode steps of the layer loop; returns (program, ring, the ring's first slots).
    ``turn=False``: every step numbered from phase 0 (the phase not carried)."""
    params, mesh = _params(L, n, me, series), _AxisMesh(n, me)
    groups = len(coalesced(params))
    layout = ring_of(params, mesh, _plan(params), k)
    ring = layout.new("cpu") if layout is not None else []
    first = list(ring)
    rec = Recorder(ring)
    phase = RingPhase()
    with rec:
        prefetch.start(params, mesh, layout, ring)  # layers 0 .. k-1, issued before the first step
        for step in range(steps):
            if not turn:
                phase = RingPhase()
            weights = prefetch.layer_weights(params, ring, mesh, _plan(params), ring=layout, phase=phase)
            x = torch.zeros(())
            for i in range(L):
                rec.layer = step * L + i
                layer = weights(i, x)
                x = x + sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(layer))
        assert [t.data_ptr() for t in ring] == [t.data_ptr() for t in first]  # the list is never reordered
        if turn and n > 1:
            assert phase.at == steps * L % (k + 1)
    return rec.program(0, groups), ring, first, groups


@settings(max_examples=150, deadline=None)
@given(
    L=st.integers(1, 64),
    n=st.integers(1, 8),
    data=st.data(),
    series=st.integers(1, 4),
)
def test_ring_never_overflows_and_every_access_is_ordered(L, n, data, series):
    k = data.draw(st.integers(0, L + 2), label="k")
    me = data.draw(st.integers(0, n - 1), label="rank")
    if k > L - 1:  # more slots than layers: refused in one line, naming the bound
        with pytest.raises(ValueError, match=rf"0 <= k <= num_layers - 1 = {L - 1} \(the model has {L} layers"):
            prefetch.check_prefetch_step(k, L)
        return
    program, ring, first, groups = _run(L, n, me, k, series)
    if n == 1:  # every layer local: no ring, no broadcast
        assert ring == [] and not program.writes
        return
    assert len(ring) == (k + 1) * groups  # the ring: k + 1 slots per dtype group, the same tensors after two steps
    assert {t.untyped_storage().data_ptr() for t in ring} == {t.untyped_storage().data_ptr() for t in first}
    assert len(program.writes) == (2 * L + k) * groups and len(program.reads) >= 2 * L * groups
    assert check(program, k, slots=(k + 1) * groups) == []


def test_vllm_54975_slot_index_without_the_phase():
    """vLLM's issue 54975: with L not a multiple of k + 1, numbering each step's slots l mod (k + 1) afresh puts the
    next step's first layers into slots still holding this step's last ones. The ring's phase fixes it; without it
    the check finds the wrong layer read."""
    for L, k in [(5, 1), (7, 2), (6, 3)]:
        assert L % (k + 1)
        good, *_ = _run(L, 2, 0, k, 1)
        assert check(good, k, slots=k + 1) == []
        bad, *_ = _run(L, 2, 0, k, 1, steps=3, turn=False)
        out = check(bad, k, slots=k + 1)
        # the next step's first layer, v = L + k, written into the slot its step-local number k names, not its own
        v, wrong = L + k, k % (k + 1)
        write = rf"the right layer: \d+:write:slot{wrong} writes layer {v} into slot{wrong} \(ring slot {wrong}\); "
        assert any(re.fullmatch(write + rf"layer {v} belongs in ring slot {v % (k + 1)}", x) for x in out), out
        # ... and the next step's layer L + j read from where the unturned ring put it
        read = r"the right layer: \d+:read:slot(\d) reads layer (\d+) from slot\1 \(ring slot \1\), which holds layer "
        read += r"\d+ then"
        assert any(re.fullmatch(read, x) for x in out), out
    ok, *_ = _run(6, 2, 0, 1, 1, steps=3, turn=False)  # L a multiple of k + 1: the phase stays 0
    assert check(ok, 1, slots=2) == []


# ---- negative cases: programs with one thing wrong --------------------------------------------------
def _simulate(L: int, k: int, slots: int, *, gate: bool = True, alloc: bool = False, turn: bool = True) -> Program:
    """One step of a layer loop over a ring as a partial order, built here from first principles: per layer ``i``,
    ``gate`` (the residual entering the layer), ``issue`` of layer ``i + k`` into slot ``(i + k) mod slots`` (after
    the gate if ``gate``; the previous issue on the prefetch stream), ``wait`` on layer ``i``'s slot, ``read``s of
    it, and the layer's output. ``turn=False`` numbers the next step's layers from 0."""
    ops: list[str] = []
    after: dict[str, list[str]] = {}
    writes, waits, reads, allocs = {}, {}, {}, {}
    slot_layer = {}
    last_issue, x = None, None

    def op(name: str, *deps: str | None) -> str:
        ops.append(name)
        after[name] = [d for d in deps if d]
        return name

    def slot(v: int) -> str:
        return f"slot{(v if turn or v < L else v - L) % slots}"

    initial = {slot(j): j for j in range(k)}
    for i in range(L):
        g = op(f"x{i}", x)
        v = i + k
        w = op(f"issue{v}", g if gate else None, last_issue)
        writes[w] = (slot(v), v)
        if alloc:
            allocs[w] = 64
        last_issue = w
        src = [name for name, (s, lay) in writes.items() if lay == i]
        wt = op(f"wait{i}", *(src or [g]), g)
        waits[wt] = slot(i)
        r = op(f"read{i}", wt)
        reads[r] = (slot(i), i)
        x = op(f"out{i}", r, g)
        slot_layer[i] = slot(i)
    return Program(ops, after, writes, waits, reads, allocs, initial)


@pytest.mark.parametrize("L,k", [(4, 1), (6, 2), (5, 0)])
def test_simulated_ring_passes(L, k):
    assert check(_simulate(L, k, k + 1), k, slots=k + 1) == []


def test_no_gate_is_write_after_read():
    """The no-hints control: the write into a slot not ordered after the reads of the layer it held."""
    out = check(_simulate(6, 1, 2, gate=False), 1, slots=2)
    # every issue into a slot races every read of the slot that comes before its own layer's
    assert out == [
        f"write after read: issue{v} writes slot{v % 2} unordered with read{i}, which reads it"
        for i in range(6)
        for v in range(i + 2, 7, 2)
    ]


def test_allocation_inside_the_graph_is_reported():
    out = check(_simulate(4, 1, 2, alloc=True), 1, slots=2)
    assert out == [f"alloc: issue{v} allocates a 64-byte prefetch buffer inside the graph" for v in range(1, 5)]


def test_a_ring_one_slot_too_small():
    """k = 2 over two slots: layer i + 2 is written into the slot layer i is still to be read from."""
    out = check(_simulate(6, 2, 2), 2)
    assert out == [
        f"write after read: issue{i + 2} writes slot{i % 2} unordered with read{i}, which reads it" for i in range(6)
    ]
    assert check(_simulate(6, 2, 3), 2, slots=3) == []


def test_slot_index_wrong_when_L_is_not_a_multiple_of_k_plus_1():
    assert check(_simulate(5, 1, 2, turn=True), 1, slots=2) == []
    out = check(_simulate(5, 1, 2, turn=False), 1, slots=2)
    # the next step's layer 0 (v = 5) numbered 0 mod 2 lands in slot 0, whose layer 4 is being read
    assert out == ["write after read: issue5 writes slot0 unordered with read4, which reads it"]


def test_a_read_without_its_wait_is_read_before_write():
    p = _simulate(4, 1, 2)
    waits = dict(list(p.waits.items())[:-1])
    out = check(Program(p.ops, p.after, p.writes, waits, p.reads, {}, p.initial), 1)
    assert out == ["read before write: read3 reads slot1 with no wait after issue3, which writes it"]


def test_synchronous_issue_cannot_overlap():
    """k = 0 is synchronous: the check asks overlap only of k >= 1, and a k = 1 issue gated by its own layer's
    output (one layer too late) is found."""
    p = _simulate(4, 1, 2)
    late = {
        w: list(deps) + [f"out{v - 1}"]
        for w, deps in p.after.items()
        if w.startswith("issue")
        for v in [int(w[5:])]
        if v - 1 < 4
    }
    after = {op: late.get(op, deps) for op, deps in p.after.items()}
    order = sorted(p.ops, key=lambda o: _topo_key(o))
    out = check(Program(order, after, p.writes, p.waits, p.reads, {}, p.initial), 1)
    assert out == [
        f"overlap: issue{v} (layer {v}) is waited on before any earlier layer's reads can run alongside it"
        for v in (1, 2, 3)
    ]


def _topo_key(op: str) -> tuple[int, int]:
    """A topological order for the late-issue program: layer by layer, each issue after its layer's output."""
    kind, num = op.rstrip("0123456789"), int(op[len(op.rstrip("0123456789")) :])
    rank = {"x": 0, "wait": 1, "read": 2, "out": 3, "issue": 4}[kind]
    layer = num - 1 if kind == "issue" else num
    return (layer, rank)


def _moved(program: Program, op: str, before: str) -> Program:
    """A recorded (total-order) program with ``op`` moved to just before ``before``."""
    ops = [o for o in program.ops if o != op]
    ops.insert(ops.index(before), op)
    return Program(
        ops,
        {b: [a] for a, b in zip(ops, ops[1:])},
        program.writes,
        program.waits,
        program.reads,
        program.allocs,
        program.initial,
        program.slot_index,
        program.phase,
    )


def test_a_write_moved_before_a_read_of_its_slot_is_caught_in_a_total_order():
    """An eager run is a total order: write after read cannot fire. Moving layer 2's write into slot 0 before layer
    0's read of it: the read finds layer 2 (the right layer), and no wait after the write (read before write)."""
    good, *_ = _run(4, 2, 0, 1, 1, steps=1)
    assert check(good, 1, slots=2) == []
    assert good.writes["4:write:slot0"] == ("slot0", 2) and good.reads["3:read:slot0"] == ("slot0", 0)
    bad = _moved(good, "4:write:slot0", "3:read:slot0")
    assert check(bad, 1, slots=2) == [
        "read before write: 3:read:slot0 reads slot0 with no wait after 4:write:slot0, which writes it",
        "the right layer: 3:read:slot0 reads layer 0 from slot0 (ring slot 0), which holds layer 2 then",
    ]


def test_a_recorded_read_of_the_wrong_slot_is_the_right_layer():
    """The loop computing layer 1 while reading slot 0: the recorder is told the layer by the caller, not by the slot.
    (Layer 2's write, whose read is now this one, has no earlier layer's read alongside it: overlap too.)"""
    good, *_ = _run(4, 2, 0, 1, 1, steps=1)
    reads = dict(good.reads) | {"6:read:slot1": ("slot0", 1)}
    bad = Program(good.ops, good.after, good.writes, good.waits, reads, {}, good.initial, good.slot_index)
    assert check(bad, 1, slots=2) == [
        "read before write: 6:read:slot1 reads slot0 with no wait after 4:write:slot0, which writes it",
        "the right layer: 6:read:slot1 reads layer 1 from slot0 (ring slot 0), which holds layer 2 then",
        "overlap: 4:write:slot0 (layer 2) is waited on before any earlier layer's reads can run alongside it",
    ]


def test_the_binding_follows_the_schedule_and_its_phase():
    """Slot s holds the layers v with (v + phase) mod (k + 1) = s; layers 0 .. k-1 are in flight on entry."""
    assert [expected_slot(v, 2) for v in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [expected_slot(v, 2, phase=1) for v in range(6)] == [1, 2, 0, 1, 2, 0]
    assert bind(["a", "b", "c"], 2) == ({"a": 0, "b": 1, "c": 2}, {"a": 0, "b": 1})
    assert bind(["a", "b", "c"], 2, phase=2) == ({"a": 0, "b": 1, "c": 2}, {"c": 0, "a": 1})
    two = bind(["a0", "a1", "b0", "b1"], 1, groups=2)  # two buffers (dtypes) per slot
    assert two == ({"a0": 0, "a1": 0, "b0": 1, "b1": 1}, {"a0": 0, "a1": 0})
    # layer 2 belongs in slot 0 at phase 1, in slot 2 at phase 0
    write = {"w": ("a", 2)}
    assert check(Program(["w"], {}, write, slot_index={"a": 0}, phase=1), 2) == []
    assert check(Program(["w"], {}, write, slot_index={"a": 0}), 2) == [
        "the right layer: w writes layer 2 into a (ring slot 0); layer 2 belongs in ring slot 2"
    ]


def test_input_layout_and_read_layers():
    assert input_path("L['args'][3].prefetched[2]") == "args.3.prefetched.2"
    assert input_path("L['params']['layers'][10]['qkv']") == "params.layers.10.qkv"
    paths = ["params.embed", "state.kv.0.0", "state.prefetched.1", "params.layers.1.norm", "state.prefetched.0"]
    assert input_layout(paths) == ({2: 1, 4: 0}, {1: 0, 3: 1})
    # x0 -> a (read, used with layer 0's w0) -> x1 -> b (read, used with layer 1's w1) -> c (reads b's value)
    preds = {"x0": [], "w0": [], "w1": [], "a": ["x0"], "m0": ["a", "w0"], "x1": ["m0"], "b": ["x1"]}
    preds |= {"m1": ["b", "w1"], "c": ["m1"], "x2": ["c"]}
    order = list(preds)
    # b alone is after layer 0 and before layer 1's w1 (either layer); c, reading the same value, is after w1
    got = read_layers(order, preds, {"w0": 0, "w1": 1}, {"a": "v0", "b": "v1", "c": "v1"})
    assert got == {"a": 0, "b": 1, "c": 1}
    assert read_layers(order, preds, {"w0": 0, "w1": 1}, {"a": "v0", "b": "v1"}) == {"a": 0, "b": None}
    # without the per-layer inputs nothing says which layer a read is
    assert read_layers(order, preds, {}, {"a": "v0"}) == {"a": None}


def test_ring_errors():
    params, mesh = _params(4, 2, 0, 2), _AxisMesh(2, 0)
    plan = _plan(params)
    layout = ring_of(params, mesh, plan, 1)
    ring = layout.new("cpu")
    layout.check(ring)
    assert (layout.k, layout.slots, layout.buffers) == (1, 2, 4)
    with pytest.raises(ValueError, match=r"a ring of 2 buffers; expected 4 = \(k \+ 1 = 2\) x 2 per slot"):
        layout.check(ring[:2])
    small = list(ring)
    small[1] = torch.empty(5, dtype=small[1].dtype)
    size = math.prod(params["series"]["s1"].shape[1:])
    with pytest.raises(ValueError, match=rf"slot 0 buffer for series \['s1'\] is \(5,\) .*needs .* of {size}"):
        layout.check(small)
    # k is the layout's: a ring of another k's buffers is refused, never read as that k
    with pytest.raises(ValueError, match=r"a ring of 6 buffers; expected 4"):
        prefetch.layer_weights(params, ring_of(params, mesh, plan, 2).new("cpu"), mesh, plan, ring=layout)
    # and without a layout, the plan's resolved step is the ring's k
    with pytest.raises(ValueError, match=r"resolved to an int >= 0, got 'auto'"):
        ring_of(params, mesh, dataclasses.replace(plan, prefetch_step="auto"))
    assert ring_of(params, mesh, dataclasses.replace(plan, prefetch_step=1)) == layout
