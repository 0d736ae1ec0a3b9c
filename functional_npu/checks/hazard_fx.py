"""Hazard programs (:class:`functional_npu.checks.hazard.Program`) read from what torch builds.

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

Every adapter binds a slot by its place in the ring (:func:`functional_npu.checks.hazard.bind`), read off its
graph input index, and gives a read the layer of the compute that uses it, read off the graph's per-layer inputs
(:func:`functional_npu.checks.hazard.read_layers`; an eager run is told it by the caller). Which input is which is
the graph's *input layout*: each input's path (``params.layers.0.qkv``, ``state.kv.0.0``, ``state.prefetched.1``, see
:func:`functional_npu.checks.hazard.input_path`), from dynamo's sources (:func:`dynamo_inputs`) or a stored
``inputs.json``. Without one, the ring is the inputs the ring's ops write or wait on, in input order, and reads
name no layer. A graph stored as text is read back with ``tools/fx_text.py`` (outside the package).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .hazard import Program, bind, input_layout, input_path, read_layers

__all__ = [
    "from_fx",
    "from_inductor_code",
    "Recorder",
    "VIEWS",
    "dynamo_inputs",
    "fx_read_layers",
    "ring_order",
    "fx_ring",
    "fx_bind",
]

_AF = torch.ops.higher_order.auto_functionalized_v2
_OP = "functional_npu.broadcast_into.default"
_WAIT = "_c10d_functional.wait_tensor.default"
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


def dynamo_inputs(gm: torch.fx.GraphModule) -> list[str | None]:
    """The input layout of a dynamo graph (what a backend is handed): each placeholder's path, in input order (the
    order AOT autograd keeps, so the layout of the graphs it makes from this one)."""
    out: list[str | None] = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            arg = n.meta.get("grapharg")
            out.append(input_path(arg.source.name) if arg is not None and arg.source is not None else None)
    return out


def ring_order(slots: dict[int, str], ring_pos: dict[int, int]) -> list[str]:
    """The ring's buffers in ring order, from graph input index -> slot name: by their place in the ring list where
    the layout says it (``ring_pos``: input index -> position), else in input order. A written input the layout does
    not put in the ring comes after the ring (so past its last slot)."""
    if not ring_pos:
        return [slots[i] for i in sorted(slots)]
    size = max(ring_pos.values()) + 1
    out = [f"?ring{p}" for p in range(size)]
    for i, p in ring_pos.items():
        out[p] = slots.get(i, out[p])
    return out + [name for i, name in sorted(slots.items()) if i not in ring_pos]


def fx_ring(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The placeholders the input layout (each placeholder's ``meta["input_path"]``) puts in the ring."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    ring_pos, _ = input_layout([n.meta.get("input_path") for n in placeholders])
    return [placeholders[i] for i in sorted(ring_pos)]


def fx_bind(
    graph: torch.fx.Graph,
    slots: Sequence[str],
    k: int,
    groups: int = 1,
    phase: int = 0,
    inputs: Sequence[str | None] | None = None,
) -> tuple[dict[str, int], dict[str, int]]:
    """:func:`functional_npu.checks.hazard.bind` of an FX graph's slot placeholders ``slots``, by their input index
    (``inputs``: the layout, else each placeholder's ``meta["input_path"]``)."""
    index = {n.name: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    ring_pos, _ = input_layout(_paths(graph, inputs))
    return bind(ring_order({index[s]: s for s in slots if s in index}, ring_pos), k, groups, phase)


def _is_write(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target is _AF and str(n.args[0]) == _OP


def _bytes(n: torch.fx.Node) -> int:
    v = n.meta.get("val")
    return int(math.prod(v.shape)) * v.element_size() if isinstance(v, torch.Tensor) else 0


def _paths(graph: torch.fx.Graph, inputs: Sequence[str | None] | None) -> list[str | None]:
    if inputs is not None:
        return list(inputs)
    return [n.meta.get("input_path") for n in graph.nodes if n.op == "placeholder"]


def _mutated_base(n: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose memory an in-place op ``n`` writes (through views), or None."""
    schema = getattr(n.target, "_schema", None)
    if n.op != "call_function" or schema is None:
        return None
    for arg, value in zip(schema.arguments, n.args):
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.fx.Node):
            return _view_base(value)
    return None


def _view_base(n: Any) -> Any:
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.args and _aliases(n):
        n = n.args[0]
    return n


def _aliases(n: torch.fx.Node) -> bool:
    if n.target is operator.getitem:
        return False
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return False
    for ret in schema.returns:
        info = ret.alias_info
        if info is None and str(ret.type).endswith("[]") and "(a" in str(ret):
            return True
        if info is not None and not info.is_write:
            return True
    return False


def fx_read_layers(
    graph: torch.fx.Graph,
    reads: dict[str, Any],
    ring: set[str],
    inputs: Sequence[str | None] | None = None,
) -> dict[str, int | None]:
    """:func:`functional_npu.checks.hazard.read_layers` over an FX graph: its data edges, and where an op writes a
    tensor in place (a graph npugraph_ex or inductor reinplaced), an edge from it to the later users of that tensor;
    the per-layer inputs from the layout (``inputs``, else each placeholder's ``meta["input_path"]``)."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    _, layer_of = input_layout(_paths(graph, inputs))
    input_layer = {placeholders[i].name: layer for i, layer in layer_of.items() if i < len(placeholders)}
    preds: dict[str, list[str]] = {}
    writer: dict[torch.fx.Node, torch.fx.Node] = {}  # memory -> the last op that wrote it in place
    for n in nodes:
        if n.op == "output":
            continue
        deps = [a.name for a in n.all_input_nodes]
        for a in n.all_input_nodes:
            w = writer.get(_view_base(a))
            if w is not None and w is not n:
                deps.append(w.name)
        preds[n.name] = deps
        base = _mutated_base(n)
        if base is not None:
            writer[base] = n
    return read_layers([n for n in preds], preds, input_layer, reads, ring)


def from_fx(
    graph: torch.fx.Graph,
    k: int,
    groups: int = 1,
    *,
    copy_back: bool = True,
    inputs: Sequence[str | None] | None = None,
    phase: int = 0,
) -> Program:
    """The ring accesses of a functionalized graph and its data-edge partial order; ``groups`` ring buffers
    per slot (one per dtype), so the ``j``-th write carries virtual layer ``k + j // groups``. A slot is bound by
    its input index (``inputs``: the input layout, else each placeholder's ``meta["input_path"]``); a read means
    the layer of the compute that uses it (:func:`fx_read_layers`).

    ``copy_back``: the epilogue's ``copy_`` of a slot's last version into its input is a read (a compiler that
    runs it, as aot_eager does); False for a compiler whose reinplace pass writes the input in place and drops
    the copy (inductor's: check that it did on its post-grad graph)."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    ring_pos, _ = input_layout(_paths(graph, inputs))
    version: dict[torch.fx.Node, tuple[str, torch.fx.Node]] = {}  # a value of a slot -> (slot, its root value)
    for i in ring_pos:
        if i < len(placeholders):
            version[placeholders[i]] = (placeholders[i].name, placeholders[i])
    writes: dict[str, tuple[str, int]] = {}
    for j, n in enumerate(x for x in nodes if _is_write(x)):
        base = n.kwargs["_all_bases"][0]
        slot = version.get(base, (base.name if base.op == "placeholder" else f"?{base.name}", base))[0]
        version.setdefault(base, (slot, base))
        writes[n.name] = (slot, k + j // groups)
        for u in n.users:
            if u.target is operator.getitem and u.args[1] == 1:
                version[u] = (slot, u)
    for n in nodes:  # a slot read before any write: a placeholder waited on directly
        if str(n.target) == _WAIT and n.args[0].op == "placeholder" and n.args[0] not in version:
            version[n.args[0]] = (n.args[0].name, n.args[0])
    waits, reads, value_of, ring, ends = _fx_reads(version, copy_back)
    layers = fx_read_layers(graph, value_of, ring | {v.name for v in version} | set(writes), inputs)
    reads = {r: (slot, layers.get(r)) for r, (slot, _) in reads.items()}
    allocs = {}
    for n in nodes:
        if n.op == "call_function" and str(n.target).startswith("_c10d_functional.broadcast"):
            src = n.args[0]
            allocs[src.name if src.op != "placeholder" else n.name] = _bytes(src)
    slots = [n.name for n in version if n.op == "placeholder"]
    slot_index, initial = fx_bind(graph, slots, k, groups, phase, inputs)
    names = [n.name for n in nodes]
    after = {n.name: [a.name for a in n.all_input_nodes] for n in nodes} | {e: names for e in ends}
    return Program(names + ends, after, writes, waits, reads, allocs, initial, slot_index, phase)


def _fx_reads(
    version: dict[torch.fx.Node, tuple[str, torch.fx.Node]], copy_back: bool
) -> tuple[dict[str, str], dict[str, tuple[str, None]], dict[str, str], set[str], list[str]]:
    """:func:`from_fx`'s waits, reads (and the slot value each reads), the views and copies between them, and the
    copy-back reads that run after the graph: everything a slot's values reach through ``wait_tensor`` and views."""
    waits: dict[str, str] = {}
    reads: dict[str, tuple[str, None]] = {}
    value_of: dict[str, str] = {}  # read -> the slot value it reads
    ring: set[str] = set()
    last = {v for v in version if not any(_is_write(u) for u in v.users)}  # each slot's final version
    ends: list[str] = []
    frontier = [(v, slot, root) for v, (slot, root) in version.items()]
    seen = set()
    while frontier:
        v, slot, root = frontier.pop()
        for u in v.users:
            is_copy_back = u.op == "output" or (
                str(u.target) == "aten.copy_.default" and u.args[1] is v and u.args[0].op == "placeholder"
            )
            if is_copy_back and copy_back and v in last:  # after the whole graph, as the epilogue runs
                ends.append(f"copy_back:{slot}")
                reads[f"copy_back:{slot}"] = (slot, None)  # the next step's layers, handed over: no layer's compute
            if is_copy_back:
                ring.add(u.name)
            if (u, slot) in seen or _is_write(u) or is_copy_back:
                continue
            seen.add((u, slot))
            if str(u.target) == _WAIT or str(u.target) in VIEWS:
                if str(u.target) == _WAIT:
                    waits[u.name] = slot
                ring.add(u.name)
                frontier.append((u, slot, root))
            else:
                reads[u.name] = (slot, None)
                value_of[u.name] = root.name
    return waits, reads, value_of, ring, list(dict.fromkeys(ends))


_LINE_WRITE = re.compile(r"torch\.ops\.functional_npu\.broadcast_into\.default\((arg\d+_\d+|buf\d+),")
_LINE_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((arg\d+_\d+|buf\d+)\)")
_NAME = re.compile(r"\b(arg\d+_\d+|buf\d+)\b")
_ALIAS = re.compile(r"(buf\d+) = (?:reinterpret_tensor\()?(arg\d+_\d+|buf\d+)\b")


def _arg_index(name: str) -> int | None:
    m = re.fullmatch(r"arg(\d+)_\d+", name)
    return int(m.group(1)) if m else None


def from_inductor_code(
    code: str, k: int, groups: int = 1, *, inputs: Sequence[str | None] | None = None, phase: int = 0
) -> Program:
    """The ring accesses of inductor's generated ``call()`` in the order it runs them: every line comes after the
    one before. A slot is an input written by ``broadcast_into`` (or waited on, or the layout's), bound by its input
    index (``argN_1`` is input ``N``); a read is any other line naming it, and means the layer of the compute around
    it (:func:`functional_npu.checks.hazard.read_layers` over the lines' data flow, each line after the last one
    that touched a buffer it names; ``inputs``: the layout of the graph inductor compiled)."""
    if not isinstance(code, str) or "def call(self, args):" not in code:
        shown = f"{code[:40]!r}..." if isinstance(code, str) and len(code) > 40 else repr(code)
        raise ValueError(
            f"from_inductor_code: code must be inductor's generated module with its 'def call(self, args):' (e.g. "
            f"from torch._inductor.utils.run_and_get_code), got {shown}"
        )
    body = code.split("def call(self, args):")[1].split("\nrunner = ")[0]
    lines = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith(("#", "assert_"))]
    lines = [ln for ln in lines if not ln.startswith(("del ", "return", "args.clear")) and not ln.endswith("= args")]
    ring_pos, layer_of = input_layout(inputs or [])
    slots = {m.group(1) for ln in lines for m in [_LINE_WRITE.search(ln) or _LINE_WAIT.search(ln)] if m}
    slots = {s for s in slots if _arg_index(s) is not None} | {f"arg{i}_1" for i in ring_pos}
    ops = [f"{i}:{ln[:60]}" for i, ln in enumerate(lines)]
    writes: dict[str, tuple[str, int]] = {}
    waits: dict[str, str] = {}
    reads: dict[str, tuple[str, int | None]] = {}
    key: dict[str, tuple[str, int]] = {}  # read -> (slot, writes into it before): the slot value it reads
    written: dict[str, int] = {}
    j = 0
    for op, ln in zip(ops, lines):
        m = _LINE_WRITE.search(ln)
        if m:
            writes[op] = (m.group(1), k + j // groups)
            written[m.group(1)] = written.get(m.group(1), 0) + 1
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
                key[op] = (s, written.get(s, 0))
    layers = _line_layers(ops, lines, slots, layer_of, key, set(writes) | set(waits))
    reads = {op: (s, layers.get(op)) for op, (s, _) in reads.items()}
    by_index = {i: s for s in slots for i in [_arg_index(s)] if i is not None}
    slot_index, initial = bind(ring_order(by_index, ring_pos), k, groups, phase)
    return Program(ops, {b: [a] for a, b in zip(ops, ops[1:])}, writes, waits, reads, {}, initial, slot_index, phase)


def _line_layers(
    ops: list[str],
    lines: list[str],
    slots: set[str],
    layer_of: dict[int, int],
    reads: dict[str, Any],
    ring: set[str],
) -> dict[str, int | None]:
    """The layer of each read line, from the lines' data flow: a line comes after the last line that touched any
    buffer it names (an alias of a buffer is the buffer; a slot is the ring's, left out). A line that names the
    per-layer inputs of several layers (a kernel fusing work hoisted from later layers, as a copy of every layer's
    KV cache) tells no layer: it uses none of them here."""
    root: dict[str, str] = {}
    last: dict[str, str] = {}  # buffer -> the last line that named it
    preds: dict[str, list[str]] = {}
    input_layer: dict[str, int] = {}
    for name in {n for ln in lines for n in _NAME.findall(ln)}:
        i = _arg_index(name)
        if i is not None and i in layer_of:
            input_layer[f"in:{name}"] = layer_of[i]
    order = list(input_layer)
    for op, ln in zip(ops, lines):
        alias = _ALIAS.match(ln)
        if alias and "empty_strided" not in ln:
            root[alias.group(1)] = root.get(alias.group(2), alias.group(2))
        names = [n for n in dict.fromkeys(_NAME.findall(ln)) if n not in slots]
        if "empty_strided" in ln:
            continue
        own = [f"in:{n}" for n in names if f"in:{n}" in input_layer]
        deps = own if len({input_layer[n] for n in own}) == 1 else []
        for n in names:
            r = root.get(n, n)
            if r in last:
                deps.append(last[r])
            last[r] = op
        preds[op] = deps
        order.append(op)
    return read_layers(order, preds, input_layer, reads, ring, derive=False)


class Recorder(TorchDispatchMode):
    """An eager run's ring accesses in program order: use as a context around the forward, with the ring's
    tensors; ``program(k, groups)`` afterwards. The broadcasts themselves are not run (no process group needed):
    the slot keeps whatever it held, as only the order is checked. A read means the layer the caller says it
    computes (``layer``); a slot is bound by its place in ``ring`` (by storage: the same buffer, however the list
    is reordered later)."""

    def __init__(self, ring: list[torch.Tensor]) -> None:
        super().__init__()
        self.slot_of = {t.untyped_storage().data_ptr(): f"slot{i}" for i, t in enumerate(ring)}
        self.size = len(ring)
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
        if name == _WAIT:
            self.events.append(("wait", self._slot(args[0]), None))
            return args[0]
        out = func(*args, **(kwargs or {}))
        if name not in VIEWS:
            for s in {self._slot(x) for x in flat} - {None}:
                self.events.append(("read", s, self.layer))
        return out

    def program(self, first: int = 0, groups: int = 1, phase: int = 0) -> Program:
        """The recorded run; the ``j``-th write carries virtual layer ``first + j // groups``; slot ``s`` (the ring's
        buffers ``s * groups .. s * groups + groups - 1``) holds virtual layer ``v`` where ``(v + phase) mod
        (k + 1) = s`` (``k + 1``: the ring's slots)."""
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
        k = max(0, self.size // max(1, groups) - 1)
        slot_index, initial = bind([f"slot{i}" for i in range(self.size)], k, groups, phase) if self.size else ({}, {})
        return Program(
            ops, {b: [a] for a, b in zip(ops, ops[1:])}, writes, waits, reads, {}, initial, slot_index, phase
        )
