"""Hazard programs (:class:`functional_npu.parallel.hazard.Program`) read from what torch builds.

- :func:`from_fx`: a functionalized FX graph (what AOT autograd hands a backend, torchair's and
  npugraph_ex's input). Its partial order is the data edges alone: it is what every compiler that
  keeps data dependencies may reorder within, so a graph that passes holds under any of their
  schedules. A slot's versions are the placeholder and each ``auto_functionalized_v2`` of
  ``functional_npu::broadcast_into`` on it; a read is a non-view consumer of a version (through
  ``wait_tensor`` and views); a buffer built inside the graph and handed to a ``_c10d_functional``
  broadcast is an alloc.
- :func:`from_inductor_code`: inductor's generated ``call()``, a total order (each line after the one
  before): the order inductor really chose, after its own passes (``reorder_for_peak_memory`` among them).
- :class:`Recorder`: an eager run (a dispatch mode), in program order, for the property test.
"""

from __future__ import annotations

import math
import operator
import re
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .hazard import Program

__all__ = ["from_fx", "from_inductor_code", "Recorder", "VIEWS"]

_AF = torch.ops.higher_order.auto_functionalized_v2
_OP = "functional_npu.broadcast_into.default"
VIEWS = {
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.slice.Tensor",
    "aten.split_with_sizes.default",
    "aten.split.Tensor",
    "aten.t.default",
    "aten.permute.default",
    "aten.transpose.int",
    "aten.expand.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.alias.default",
    "aten.as_strided.default",
    "aten.select.int",
    "_c10d_functional.wait_tensor.default",
    "<built-in function getitem>",
}


def _is_write(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target is _AF and str(n.args[0]) == _OP


def _bytes(n: torch.fx.Node) -> int:
    v = n.meta.get("val")
    return int(math.prod(v.shape)) * v.element_size() if isinstance(v, torch.Tensor) else 0


def from_fx(graph: torch.fx.Graph, k: int, groups: int = 1, *, copy_back: bool = True) -> Program:
    """The ring accesses of a functionalized graph and its data-edge partial order; ``groups`` ring buffers
    per slot (one per dtype), so the ``j``-th write carries virtual layer ``k + j // groups``. A read means the
    layer of the version it consumes (unknown for a slot's contents on entry).

    ``copy_back``: the epilogue's ``copy_`` of a slot's last version into its input is a read (a compiler that
    runs it, as aot_eager does); False for a compiler whose reinplace pass writes the input in place and drops
    the copy (inductor's: check that it did on its post-grad graph)."""
    nodes = list(graph.nodes)
    after = {n.name: [a.name for a in n.all_input_nodes] for n in nodes}
    version: dict[torch.fx.Node, tuple[str, int | None]] = {}  # a value of a slot -> (slot, layer it holds)
    writes: dict[str, tuple[str, int]] = {}
    for j, n in enumerate(x for x in nodes if _is_write(x)):
        base = n.kwargs["_all_bases"][0]
        slot = version.get(base, (base.name if base.op == "placeholder" else f"?{base.name}", None))[0]
        version.setdefault(base, (slot, None))
        writes[n.name] = (slot, k + j // groups)
        for u in n.users:
            if u.target is operator.getitem and u.args[1] == 1:
                version[u] = (slot, k + j // groups)
    waits: dict[str, str] = {}
    reads: dict[str, tuple[str, int | None]] = {}
    last = {v for v in version if not any(_is_write(u) for u in v.users)}  # each slot's final version
    ends: list[str] = []
    frontier = list(version.items())
    seen = set()
    while frontier:
        v, (slot, layer) = frontier.pop()
        for u in v.users:
            is_copy_back = u.op == "output" or (
                str(u.target) == "aten.copy_.default" and u.args[1] is v and u.args[0].op == "placeholder"
            )
            if is_copy_back and copy_back and v in last:  # after the whole graph, as the epilogue runs
                name = f"copy_back:{slot}"
                ends.append(name)
                reads[name] = (slot, layer)
            if (u, slot) in seen or _is_write(u) or is_copy_back:
                continue
            seen.add((u, slot))
            if str(u.target) == "_c10d_functional.wait_tensor.default":
                waits[u.name] = slot
                frontier.append((u, (slot, layer)))
            elif str(u.target) in VIEWS:
                frontier.append((u, (slot, layer)))
            else:
                reads[u.name] = (slot, layer)
    allocs = {}
    for n in nodes:
        if n.op == "call_function" and str(n.target).startswith("_c10d_functional.broadcast"):
            src = n.args[0]
            allocs[src.name if src.op != "placeholder" else n.name] = _bytes(src)
    names = [n.name for n in nodes]
    ends = list(dict.fromkeys(ends))
    return Program(names + ends, after | {e: names for e in ends}, writes, waits, reads, allocs)


_LINE_WRITE = re.compile(r"torch\.ops\.functional_npu\.broadcast_into\.default\((arg\d+_\d+|buf\d+),")
_LINE_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((arg\d+_\d+|buf\d+)\)")


def from_inductor_code(code: str, k: int, groups: int = 1) -> Program:
    """The ring accesses of inductor's generated ``call()`` in the order it runs them: every line comes after the
    one before. A slot is an input written by ``broadcast_into``; a read is any other line naming it."""
    body = code.split("def call(self, args):")[1].split("\nrunner = ")[0]
    lines = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith(("#", "assert_"))]
    lines = [ln for ln in lines if not ln.startswith(("del ", "return", "args.clear"))]
    slots = {m.group(1) for ln in lines for m in [_LINE_WRITE.search(ln)] if m}
    ops = [f"{i}:{ln[:60]}" for i, ln in enumerate(lines)]
    writes: dict[str, tuple[str, int]] = {}
    waits: dict[str, str] = {}
    reads: dict[str, str] = {}
    j = 0
    for op, ln in zip(ops, lines):
        m = _LINE_WRITE.search(ln)
        if m:
            writes[op] = (m.group(1), k + j // groups)
            j += 1
            continue
        m = _LINE_WAIT.search(ln)
        if m and m.group(1) in slots:
            waits[op] = m.group(1)
            continue
        if re.fullmatch(r"\w+ = \w+", ln):
            continue  # a rename (``buf3 = arg1_1``) reads nothing
        for s in slots:
            if re.search(rf"\b{s}\b", ln):
                reads[op] = (s, None)
    return Program(ops, {b: [a] for a, b in zip(ops, ops[1:])}, writes, waits, reads, {})


class Recorder(TorchDispatchMode):
    """An eager run's ring accesses in program order: use as a context around the forward, with the ring's
    tensors; ``program(k, groups)`` afterwards. The broadcasts themselves are not run (no process group needed):
    the slot keeps whatever it held, as only the order is checked."""

    def __init__(self, ring: list[torch.Tensor]) -> None:
        super().__init__()
        self.slot_of = {t.untyped_storage().data_ptr(): f"slot{i}" for i, t in enumerate(ring)}
        self.events: list[tuple[str, str | None, int | None]] = []
        self.layer: int | None = None  # the layer the caller computes now (what its reads mean)

    def _slot(self, x: Any) -> str | None:
        if isinstance(x, torch.Tensor):
            return self.slot_of.get(x.untyped_storage().data_ptr())
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        if name == _OP:
            self.events.append(("write", self._slot(args[0]), None))
            return None
        if name == "_c10d_functional.wait_tensor.default":
            self.events.append(("wait", self._slot(args[0]), None))
            return args[0]
        out = func(*args, **(kwargs or {}))
        if name not in VIEWS:
            for s in {self._slot(x) for x in flat} - {None}:
                self.events.append(("read", s, self.layer))
        return out

    def program(self, first: int = 0, groups: int = 1) -> Program:
        """The recorded run; the ``j``-th write carries virtual layer ``first + j // groups``."""
        ops = [f"{i}:{kind}:{slot}" for i, (kind, slot, _) in enumerate(self.events)]
        writes, waits, reads = {}, {}, {}
        j = 0
        for op, (kind, slot, layer) in zip(ops, self.events):
            if kind == "write":
                writes[op] = (str(slot), first + j // groups)
                j += 1
            elif kind == "wait" and slot:
                waits[op] = slot
            elif kind == "read":
                reads[op] = (str(slot), layer)
        return Program(ops, {b: [a] for a, b in zip(ops, ops[1:])}, writes, waits, reads, {})
