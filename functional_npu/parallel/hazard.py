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
- **the right layer**: a read told which layer it means finds that layer in the slot (a wrong slot
  index shows here even in a total order);
- **overlap** (``k >= 1``): every write whose layer is read in the graph can run alongside at least one
  layer of compute before its use: some read of an earlier layer is ordered neither before the write
  nor after the wait that completes it, and comes before one of the write's reads. In a total order
  (what a compiler chose) that is a read between the write and its wait; a wait hoisted to right after
  its write fails (a write with no earlier layer in the program, as the first step's first ``k``, has
  nothing to overlap);
- **bound**: no alloc, and at most ``slots`` distinct slots per ring.

The adapters that build a :class:`Program` from an FX graph, inductor's generated code, a GE graph or a
captured graph's stream order live beside the graphs they read (:mod:`functional_npu.parallel.hazard_fx`,
:mod:`functional_npu.npu.ge_graph`, :mod:`functional_npu.npu.acl_graph`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Program", "check", "ancestors"]


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
    """

    ops: Sequence[str]
    after: Mapping[str, Sequence[str]]
    writes: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    waits: Mapping[str, str] = field(default_factory=dict)
    reads: Mapping[str, tuple[str, int | None]] = field(default_factory=dict)
    allocs: Mapping[str, int] = field(default_factory=dict)
    initial: Mapping[str, int] = field(default_factory=dict)


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


def check(program: Program, k: int, slots: int | None = None) -> list[str]:
    """Every hazard in ``program`` for a ring at prefetch step ``k`` (see the module docstring); empty when safe."""
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
    for slot, ws in by_slot.items():
        out += [
            f"write after write: {a} and {b} write {slot} unordered" for a, b in zip(ws, ws[1:]) if not before(a, b)
        ]
    layer_read: dict[str, int | None] = {}  # read -> the layer it really reads (None: the slot's initial contents)
    reads_of: dict[str, list[str]] = {}  # write -> the reads of what it wrote
    for r, (slot, want) in program.reads.items():
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
        if want is not None and held is not None and held != want and not racing:
            later = [w for w in ws if before(r, w) and program.writes[w][1] == want]
            kind = "read before write" if later else "write after read"
            out.append(f"{kind}: {r} reads layer {want} from {slot}, which holds layer {held} then")
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
