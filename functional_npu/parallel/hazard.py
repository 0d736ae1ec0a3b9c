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
- **overlap** (``k >= 1``): every write whose layer is read in the graph can run alongside at least one
  read of an earlier layer, i.e. some read of another layer is ordered neither before the write nor
  after the write's first read... precisely: some read of a lower layer is not an ancestor of the write
  but is an ancestor of one of the write's reads;
- **bound**: no alloc, and at most ``slots`` distinct slots per ring.

The adapters that build a :class:`Program` from an FX graph, inductor's generated code, a GE graph or a
captured graph's stream order live beside the graphs they read (:mod:`functional_npu.parallel.hazard_fx`,
:mod:`functional_npu.npu.ge_graph`).
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
        reads: op -> slot it reads.
        allocs: op -> bytes of a prefetch buffer it allocates inside the graph.
    """

    ops: Sequence[str]
    after: Mapping[str, Sequence[str]]
    writes: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    waits: Mapping[str, str] = field(default_factory=dict)
    reads: Mapping[str, str] = field(default_factory=dict)
    allocs: Mapping[str, int] = field(default_factory=dict)


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
    used = set(by_slot) | set(program.reads.values())
    if slots is not None and len(used) > slots:
        out.append(f"bound: {len(used)} slots used, the ring has {slots}")
    for slot, ws in by_slot.items():
        out += [f"write after write: {a} and {b} both write {slot} unordered" for a, b in zip(ws, ws[1:]) if not before(a, b)]
    layer_of_read: dict[str, int] = {}
    for r, slot in program.reads.items():
        ws = by_slot.get(slot, [])
        last = [w for w in ws if before(w, r)]
        for w in ws:
            if w not in last and not before(r, w):
                out.append(f"write after read: {w} writes {slot} unordered with {r}, which reads it")
        if last:
            w = last[-1]
            layer_of_read[r] = program.writes[w][1]
            if not any(s == slot and before(w, q) and before(q, r) for q, s in program.waits.items()):
                out.append(f"read before write: {r} reads {slot} with no wait after {w}, which writes it")
    if k >= 1:
        reads_of: dict[str, list[str]] = {}
        for r, slot in program.reads.items():
            ws = [w for w in by_slot.get(slot, []) if before(w, r)]
            if ws:
                reads_of.setdefault(ws[-1], []).append(r)
        for w, rs in reads_of.items():
            v = program.writes[w][1]
            earlier = [r for r, lay in layer_of_read.items() if lay < v] + [
                r for r in program.reads if r not in layer_of_read
            ]  # reads of the carried (initial) contents are of earlier layers
            if not any(not before(e, w) and any(before(e, r) for r in rs) for e in earlier):
                out.append(f"overlap: {w} (layer {v}) cannot run alongside any earlier layer's reads before its use")
    return out
