"""The prefetch ring's hazard check: over a graph's partial order, every slot access is safely ordered.

A compiled step is a set of ops and a partial order among them (data and control edges; for a
captured graph, stream order and events). A prefetch ring adds four kinds of op, by slot:

- a *write* starts putting virtual layer ``v``'s weights into a slot (a broadcast into it);
- a *wait* completes the write before it on that slot;
- a *read* reads what the slot holds (the compute of a layer);
- an *alloc* creates a prefetch buffer inside the graph (a ring never needs one).

:func:`check` returns every violation (empty: the order is safe under any schedule a compiler, GE or
a stream may pick within the partial order):

- **write after read**: every write into a slot is ordered with every read of the slot, so no write can
  overwrite a layer some read has not finished with (nor a read see the next layer);
- **read before write**: every read comes after a wait that comes after the last write before it;
- **write after write**: the writes into one slot are totally ordered;
- **the right layer**: every write carries its layer into that layer's slot, and a read told which layer it
  means finds that layer in the slot (see *binding* below; a wrong slot index, or two slot inputs swapped,
  shows here even in a total order);
- **overlap** (``k >= 1``): every write whose layer is read in the graph can run alongside at least one
  layer of compute before its use: some read of an earlier layer is ordered neither before the write
  nor after the wait that completes it, and comes before one of the write's reads. In a total order
  (what a compiler chose) that is a read between the write and its wait; a wait hoisted to right after
  its write fails (a write with no earlier layer in the program, as the first step's first ``k``, has
  nothing to overlap);
- **bound**: no alloc, and at most ``slots`` distinct slots per ring.

**Binding.** Which layer a slot must hold is not read from the graph's ring accesses: a slot is bound by its
position in the ring (:func:`bind`: the ring list is the step's input ``state.prefetched``, slot ``s`` group ``g``
is ``ring[s * groups + g]``; an adapter reads the position off the slot's graph input index) to the ring's schedule
(:func:`expected_slot`: virtual layer ``v`` belongs in slot ``(v + phase) mod (k + 1)``; layers ``0 .. k-1`` are in
their slots, in flight, when the step starts). A read's layer is the layer of the compute that uses it, read off the
graph's other per-layer inputs (:func:`read_layers`; the reads of one value of a slot share their layer, but which
layer it is never comes from that value or the write that made it). So a graph that reads or writes a slot other
than the schedule's fails, however consistent its own data flow is.

**Orders.** What can fire depends on the order an adapter reads. Over a partial order (a GE graph's edges, a
captured graph's streams and events, an FX graph's data edges) every claim can fire. Over a total order (an
eager run, inductor's generated code) every pair of accesses is ordered, so *write after read* and *write after
write* cannot fire; a write moved before a read of its slot's previous layer shows there as *the right layer*
(the read finds the new layer), and a read moved before its wait as *read before write*.

The adapters that build a :class:`Program` from an FX graph, inductor's generated code, a GE graph or a
captured graph's stream order live beside the graphs they read (:mod:`functional_npu.checks.hazard_fx`,
:mod:`functional_npu.npu.ge_graph`, :mod:`functional_npu.npu.acl_graph`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Program", "check", "ancestors", "expected_slot", "bind", "read_layers", "input_layout", "input_path"]


@dataclass(frozen=True)
class Program:
    """Ops in a topological order, what each must come after, and the ring accesses among them.

    Attributes:
        ops: op names, each after everything in its ``after``.
        after: op -> the ops it directly waits for (data, control, stream and event edges).
        writes: op -> (slot, virtual layer) it starts writing.
        waits: op -> slot whose last write it completes.
        reads: op -> (slot, the layer it means to read, or None where the graph does not say).
        allocs: op -> bytes of a prefetch buffer it allocates inside the graph.
        initial: slot -> the layer it holds when the program starts (carried in flight from the step before).
        slot_index: slot -> its ring slot ``s`` (from its position in the ring, :func:`bind`); empty where the
            program does not say, and then no write is checked against the schedule.
        phase: the schedule's phase: virtual layer ``v`` belongs in ring slot ``(v + phase) mod (k + 1)``.
    """

    ops: Sequence[str]
    after: Mapping[str, Sequence[str]]
    writes: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    waits: Mapping[str, str] = field(default_factory=dict)
    reads: Mapping[str, tuple[str, int | None]] = field(default_factory=dict)
    allocs: Mapping[str, int] = field(default_factory=dict)
    initial: Mapping[str, int] = field(default_factory=dict)
    slot_index: Mapping[str, int] = field(default_factory=dict)
    phase: int = 0

    def __post_init__(self) -> None:
        """One line for ops that are not distinct names, or an access by an op not among them."""
        if isinstance(self.ops, str) or not all(isinstance(op, str) for op in self.ops):
            raise TypeError(f"Program: ops must be a sequence of op names such as ['w0', 'r0'], got {self.ops!r}")
        if len(set(self.ops)) != len(self.ops):
            twice = next(op for op in self.ops if self.ops.count(op) > 1)
            raise ValueError(f"Program: op {twice!r} appears twice in ops; name each op once")
        known = set(self.ops)
        for name in ("writes", "waits", "reads", "allocs"):
            stray = [op for op in getattr(self, name) if op not in known]
            if stray:
                raise ValueError(f"Program: {name} names op {stray[0]!r}, which is not in ops; add it to ops in order")


def expected_slot(v: int, k: int, phase: int = 0) -> int:
    """The ring slot virtual layer ``v`` belongs in, at prefetch step ``k``: ``(v + phase) mod (k + 1)``."""
    _check_k(k, "expected_slot")
    return (v + phase) % (k + 1)


def _check_k(k: Any, where: str) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"{where}: k (the prefetch step: a ring of k + 1 slots) must be an int >= 0, got {k!r}")


def bind(ring: Sequence[str], k: int, groups: int = 1, phase: int = 0) -> tuple[dict[str, int], dict[str, int]]:
    """The schedule's binding of a ring's buffers, given in ring order (position ``p = s * groups + g``: slot ``s``,
    group ``g``, as the step's ``state.prefetched`` lists them): ``(slot_index, initial)``, each buffer's ring slot
    and the layer it holds when the step starts (layers ``0 .. k-1``, in flight from the step before)."""
    groups = max(1, groups)
    slot_index = {name: p // groups for p, name in enumerate(ring)}
    initial = {}
    for v in range(k):
        s = expected_slot(v, k, phase)
        for name in ring[s * groups : (s + 1) * groups]:
            initial[name] = v
    return slot_index, initial


_PATH_KEY = re.compile(r"\['([^']*)'\]|\[\"([^\"]*)\"\]|\[(\d+)\]|\.(\w+)")


def input_path(source: str) -> str:
    """A graph input's dotted path from dynamo's source name: ``L['params']['layers'][0]['qkv']`` ->
    ``params.layers.0.qkv``, ``L['state'].prefetched[2]`` -> ``state.prefetched.2``."""
    head, _, rest = source.partition("[")
    keys = [next(g for g in m.groups() if g is not None) for m in _PATH_KEY.finditer("[" + rest if rest else "")]
    if head not in ("L", "") and not head.startswith("L"):
        keys.insert(0, head)
    return ".".join(keys)


_RING_PATH = re.compile(r"(?:^|\.)prefetched\.(\d+)$")
_LAYER_PATH = re.compile(r"(?:^|\.)(?:layers|kv)\.(\d+)(?:\.|$)")


def input_layout(paths: Sequence[str | None]) -> tuple[dict[int, int], dict[int, int]]:
    """What a graph's input paths (in input order, :func:`input_path`) say about the ring and the layers:
    ``(ring, layer)``, input index -> its position in the ring list ``state.prefetched``, and input index -> the
    layer of a per-layer input (``params.layers.{i}.*``, the KV cache ``state.kv.{i}``)."""
    ring, layer = {}, {}
    for i, path in enumerate(paths):
        if not path:
            continue
        if m := _RING_PATH.search(path):
            ring[i] = int(m.group(1))
        elif m := _LAYER_PATH.search(path):
            layer[i] = int(m.group(1))
    return ring, layer


def read_layers(
    order: Sequence[str],
    preds: Mapping[str, Sequence[str]],
    input_layer: Mapping[str, int],
    reads: Mapping[str, Any],
    ring: Collection[str] = (),
    num_layers: int | None = None,
    derive: bool = True,
) -> dict[str, int | None]:
    """The layer of the compute each read belongs to, from the graph's per-layer inputs alone (not the ring's).

    ``order``: nodes in a topological order of the data edges ``preds``; ``input_layer``: the per-layer inputs (a
    layer's own weights, its KV cache) and their layers; ``reads``: read -> a key shared by the reads of one value
    of a slot; ``ring``: the ring's own nodes (slots, writes, waits, views of a slot's value), left out;
    ``derive``: a node with one input that is a per-layer input's value (a view, a transpose) is that input's too
    (False where a node may make several values, as a line of generated code).

    A layer's compute uses its own per-layer inputs only, comes after every earlier layer's and before every later
    one's, so a read's layer is at least the largest layer of a per-layer input among its ancestors and at most
    the smallest among the per-layer inputs its descendants (and itself) use. Where that pins one layer, it is
    the read's; else the reads of one value of a slot (one layer's weights) pin it together; else None.
    """
    if not input_layer:
        return dict.fromkeys(reads)
    top = max(input_layer.values()) if num_layers is None else num_layers - 1
    skip = set(ring)
    up: dict[str, int] = {}
    weight: dict[str, int] = {}  # a per-layer input, or a value made from one alone (its views, its transpose)
    use: dict[str, int] = {}  # the smallest layer of a per-layer input the node uses
    succs: dict[str, list[str]] = {}
    for n in order:
        if n in skip:
            continue
        ps = [p for p in preds.get(n, ()) if p not in skip and p in up]
        for p in ps:
            succs.setdefault(p, []).append(n)
        if n in input_layer:
            up[n] = weight[n] = input_layer[n]
            continue
        up[n] = max((up[p] for p in ps), default=-1)
        used = [weight[p] for p in ps if p in weight]
        if used:
            use[n] = min(used)
        if derive and len(ps) == 1 and ps[0] in weight and n not in reads:
            weight[n] = weight[ps[0]]
    down: dict[str, int] = {}
    for n in reversed(order):
        if n in up:
            down[n] = min([use.get(n, top + 1)] + [down[c] for c in succs.get(n, ())])
    span = {r: (max(0, up.get(r, -1)), min(top, down.get(r, top + 1))) for r in reads}
    together: dict[Any, tuple[int, int]] = {}
    for r, key in reads.items():
        lo, hi = together.get(key, (0, top))
        together[key] = (max(lo, span[r][0]), min(hi, span[r][1]))
    out: dict[str, int | None] = {}
    for r, key in reads.items():
        lo, hi = span[r] if span[r][0] == span[r][1] else together[key]
        out[r] = lo if lo == hi else None
    return out


def ancestors(program: Program) -> dict[str, int]:
    """Each op's strict ancestors as a bit set over ``program.ops`` (bit ``i``: ``ops[i]``)."""
    index = {op: i for i, op in enumerate(program.ops)}
    anc: dict[str, int] = {}
    for op in program.ops:
        bits = 0
        for dep in program.after.get(op, ()):
            if dep not in anc:
                raise ValueError(f"hazard: {op} comes after {dep}, which is not an earlier op of the program")
            bits |= anc[dep] | (1 << index[dep])
        anc[op] = bits
    return anc


def _slot_name(program: Program, slot: str) -> str:
    s = program.slot_index.get(slot)
    return slot if s is None else f"{slot} (ring slot {s})"


def _misplaced(program: Program, k: int, index: Mapping[str, int]) -> list[str]:
    """The writes into a slot their layer does not belong in (by the slots' binding), in program order."""
    out = []
    for w in sorted(program.writes, key=index.__getitem__):
        slot, v = program.writes[w]
        s, want = program.slot_index.get(slot), expected_slot(v, k, program.phase)
        if s is not None and s != want:
            out.append(
                f"the right layer: {w} writes layer {v} into {slot} (ring slot {s}); layer {v} belongs in ring slot "
                f"{want}"
            )
    return out


def check(program: Program, k: int, slots: int | None = None) -> list[str]:
    """Every hazard in ``program`` for a ring at prefetch step ``k`` (see the module docstring); empty when safe."""
    if not isinstance(program, Program):
        raise TypeError(f"check: program must be a Program (from_fx, from_inductor_code, ...), got {program!r:.80}")
    _check_k(k, "check")
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 0):
        raise ValueError(f"check: slots (the ring's slots) must be an int >= 0 or None, got {slots!r}")
    index = {op: i for i, op in enumerate(program.ops)}
    anc = ancestors(program)

    def before(a: str, b: str) -> bool:
        return bool(anc[b] >> index[a] & 1)

    out = [f"alloc: {op} allocates a {n}-byte prefetch buffer inside the graph" for op, n in program.allocs.items()]
    by_slot: dict[str, list[str]] = {}
    for op, (slot, _) in program.writes.items():
        by_slot.setdefault(slot, []).append(op)
    for ws in by_slot.values():
        ws.sort(key=index.__getitem__)
    used = set(by_slot) | {slot for slot, _ in program.reads.values()}
    if slots is not None and len(used) > slots:
        out.append(f"bound: {len(used)} slots used, the ring has {slots}")
    out += _misplaced(program, k, index)
    for slot, ws in by_slot.items():
        out += [
            f"write after write: {a} and {b} write {slot} unordered" for a, b in zip(ws, ws[1:]) if not before(a, b)
        ]
    layer_read: dict[str, int | None] = {}  # read -> the layer it really reads (None: the slot's initial contents)
    reads_of: dict[str, list[str]] = {}  # write -> the reads of what it wrote
    for r in sorted(program.reads, key=index.__getitem__):
        slot, want = program.reads[r]
        ws = by_slot.get(slot, [])
        racing = [w for w in ws if not before(w, r) and not before(r, w)]
        out += [f"write after read: {w} writes {slot} unordered with {r}, which reads it" for w in racing]
        last = [w for w in ws if before(w, r)]
        held = program.writes[last[-1]][1] if last else program.initial.get(slot)
        layer_read[r] = held
        if last:
            reads_of.setdefault(last[-1], []).append(r)
            if not any(s == slot and before(last[-1], q) and before(q, r) for q, s in program.waits.items()):
                out.append(f"read before write: {r} reads {slot} with no wait after {last[-1]}, which writes it")
        known = held is not None or slot in program.slot_index  # a bound slot holds nothing of this step unwritten
        if want is not None and known and held != want and not racing:
            holds = f"layer {held}" if held is not None else "no layer of this step"
            later = [w for w in ws if before(r, w) and program.writes[w][1] == want]
            note = f"; layer {want} is written after it, by {later[0]}" if later else ""
            out.append(
                f"the right layer: {r} reads layer {want} from {_slot_name(program, slot)}, which holds {holds} "
                f"then{note}"
            )
    if k >= 1:
        for w, rs in reads_of.items():
            v, slot = program.writes[w][1], program.writes[w][0]
            # the waits that complete this write for its reads
            qs = [q for q, s in program.waits.items() if s == slot and before(w, q) and any(before(q, r) for r in rs)]
            earlier = [r for r, lay in layer_read.items() if lay is None or lay < v]

            def alongside(e: str, rs: list[str] = rs, qs: list[str] = qs) -> bool:
                """``e`` may run after the write starts and before the wait that ends it, and comes before a use."""
                return not before(e, w) and not any(before(q, e) for q in qs) and any(before(e, r) for r in rs)

            if earlier and not any(alongside(e) for e in earlier):
                out.append(
                    f"overlap: {w} (layer {v}) is waited on before any earlier layer's reads can run alongside it"
                )
    return out
