"""npugraph_ex (ACL graph capture) on a host with no NPU: the graph it would capture, and its stream order.

``torch.compile(backend="npugraph_ex")`` (registered by ``torch_npu.dynamo``) runs npugraph_ex's
``get_npu_backend``: ``replace_stream_event_pass`` on the dynamo graph, AOT autograd with its
decompositions (``keep_inference_input_mutations=True``), then per graph its FX passes (noop removal,
view-inplace recovery, pattern fusion, view->reshape, cat removal, the stream scopes' event closure,
reinplacing, reinplacing of mutated inputs, ``decompose_auto_functionalized``, self-copy elimination) and
finally ``AclGraph``, which captures the resulting FX graph op by op into an NPU graph. That last step
needs a device; everything before it is Python. :func:`install` makes it run in *this* process (a
subprocess of its own: it changes the import system), with stand-ins only for what needs a device:

- ``torch_npu``: an empty package whose ``npu`` is the ``torch.npu`` stand-in below (``import torch_npu``
  succeeds, every submodule import fails with ``ImportError``, which npugraph_ex catches where it is
  optional). npugraph_ex imports it to assert it exists (``fx2acl_converter.py:72``,
  ``ops/_tagged_event.py:14``) and probes ``torch_npu.npu`` for a CANN feature (``static_kernel.py:30``).
- ``torch.npu``: ``Stream`` / ``Event`` / ``current_stream`` / ``set_stream`` / ``stream`` objects that hold
  ids and do nothing (npugraph_ex creates its events and reads the current stream's id while compiling).
- ``npugraph_ex._acl_concrete_graph.fx2acl_converter.AclGraph``: the capture. The stand-in records the FX
  graph it is given (after every pass), the stream labels and tagged events npugraph_ex collected, and
  raises :class:`HandedToCapture`: conversion ends exactly where capture would begin (a replay,
  :mod:`functional_npu.npu.acl_replay`, lets the compile go on to npugraph_ex's generated graph module).

One pass does not run: ``pattern_fusion_pass`` (``patterns/``), whose patterns are written with torch_npu's
ops (e.g. ``torch.ops.npu.npu_add_rms_norm``, ``patterns/add_rms_norm_dynamic_quant.py:75``), which exist only
with its native library. It fuses compute ops; it neither moves nor removes scope markers and events.

Nothing here fakes a kernel, a stream or an event's behaviour: :func:`capture_order` reads the
stream and event semantics off the graph as npugraph_ex's generated forward executes it (one
``torch.npu.stream`` per ``_user_stream_label``, ``tagged_event_record``/``wait`` on the current stream),
and :func:`program` turns that into a :class:`functional_npu.checks.hazard.Program`.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import itertools
import operator
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checks import hazard
from ..core.collectives import BROADCAST_INTO
from . import host

__all__ = [
    "HandedToCapture",
    "handed",
    "install",
    "backend",
    "capture",
    "CaptureOrder",
    "capture_order",
    "edges",
    "program",
    "prefetch_report",
]

BLOCKED = "torch_npu"
PASSES_NOT_RUN = ("pattern_fusion_pass",)  # npugraph_ex passes this host cannot run (their ops are torch_npu's)
SCOPE_ENTER, SCOPE_EXIT = "npugraph_ex.scope_enter.default", "npugraph_ex.scope_exit.default"
RECORD, WAIT = "npugraph_ex.tagged_event_record.default", "npugraph_ex.tagged_event_wait.default"
RECORD_ON, WAIT_ON = (
    "npugraph_ex.tagged_event_record_on_stream.default",
    "npugraph_ex.tagged_event_wait_on_stream.default",
)
WAIT_TENSOR = "_c10d_functional.wait_tensor.default"
MAIN = "main"  # the stream the graph is captured on


class HandedToCapture(Exception):  # noqa: N818 - not an error: the point where conversion ends
    """Raised by the ``AclGraph`` stand-in when npugraph_ex would start capturing."""


_HANDED: list[dict[str, Any]] = []


def handed() -> list[dict[str, Any]]:
    """``{"gm", "tagged_events", "stream_labels"}`` for every graph handed to capture in this process, in order."""
    return list(_HANDED)


# ---- stand-ins ----------------------------------------------------------------------------------
class _Stream:
    """``torch.npu.Stream`` as npugraph_ex reads it while compiling: ids only. Its waits are reached only by a replay
    (:mod:`functional_npu.npu.acl_replay`), which runs every op in program order on the CPU: nothing to order."""

    _ids = itertools.count(1)

    def __init__(self, stream_id: int | None = None, device_index: int = 0, device_type: int = 20, **_: Any) -> None:
        self.stream_id = next(self._ids) if stream_id is None else stream_id
        self.device_index, self.device_type = device_index, device_type

    def wait_event(self, event: Any) -> None:
        return None

    record_event = wait_stream = wait_event


class _Event:
    """``torch.npu.Event``: created while compiling (npugraph_ex registers its tagged events); recorded and waited
    only by a replay, where every op runs in program order on the CPU, so they do nothing."""

    def record(self, *_: Any) -> None:
        return None

    wait = record


CORE_LIMITS = {"cube_core_num": 24, "vector_core_num": 48}  # what the stand-in stream reports (fixed: never changes)


def _npu_namespace() -> types.ModuleType:
    npu = types.ModuleType("torch.npu", "stand-in: the stream and event objects npugraph_ex creates while compiling")
    default = _Stream(0)
    npu.__dict__.update(
        Stream=_Stream,
        Event=_Event,
        current_stream=lambda *_: default,
        default_stream=lambda *_: default,
        set_stream=lambda *_: None,
        stream=lambda *_: contextlib.nullcontext(),
        is_available=lambda: False,
        device_count=lambda: 0,
        current_device=lambda: 0,
        synchronize=lambda *_: None,
        get_stream_limit=lambda *_: dict(CORE_LIMITS),
        get_device_limit=lambda *_: dict(CORE_LIMITS),
    )
    return npu


class _AclGraph:
    """Stand-in for npugraph_ex's ``AclGraph`` (the capture into an NPU graph) as its compiler makes it
    (``fx2acl_converter.py``, ``AclGraph(fx_graph=...).load(info)``): records what it is handed, then stops the
    compile (``stop``; a replay, :mod:`functional_npu.npu.acl_replay`, lets it go on to npugraph_ex's generated
    module)."""

    stop = True

    def __init__(self, fx_graph: torch.fx.GraphModule, config: Any = None, **_: Any) -> None:
        self.fx_graph = fx_graph
        self.name = None  # the graph's name once loaded (npugraph_ex logs it after codegen)

    def load(self, info: Any, *_: Any, **__: Any) -> None:
        self.name = getattr(info, "fx_graph_name", None)
        _HANDED.append(
            {
                "gm": self.fx_graph,
                "name": getattr(info, "fx_graph_name", None),
                "tagged_events": list(getattr(info, "tagged_event_names", [])),
                "stream_labels": sorted(getattr(info, "user_stream_label", ())),
            }
        )
        if self.stop:
            raise HandedToCapture(f"FX graph with {len(self.fx_graph.graph.nodes)} nodes handed to capture")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves an empty ``torch_npu`` package; its submodules do not exist."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == BLOCKED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if name.startswith(BLOCKED + "."):
            raise ImportError(f"{name}: torch_npu is a stand-in here (graph conversion only)", name=name)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = types.ModuleType(spec.name, "stand-in: torch_npu is not installed; npugraph_ex only checks it imports")
        mod.__path__ = []  # a package with no submodules
        if not hasattr(torch, "npu"):
            torch.npu = _npu_namespace()  # type: ignore[attr-defined]
        mod.npu = torch.npu  # type: ignore[attr-defined]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install(dynamo_dir: Path) -> None:
    """Make ``import npugraph_ex`` work here, up to capture (see the module docstring). Run in a process of its
    own started with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``; ``dynamo_dir`` is the wheel's ``torch_npu/dynamo``."""
    if BLOCKED in sys.modules and not isinstance(sys.modules[BLOCKED].__spec__.loader, _Finder):
        raise RuntimeError(f"{BLOCKED} is already imported in this process; convert in a process without it")
    host.put_on_path(dynamo_dir, "npugraph_ex", _Finder())
    if not hasattr(torch, "npu"):
        torch.npu = _npu_namespace()  # type: ignore[attr-defined]
    from npugraph_ex._acl_concrete_graph import fx2acl_converter  # type: ignore[import-not-found]

    fx2acl_converter.AclGraph = _AclGraph


def backend(config: Any, decompositions: dict | None = None) -> Any:
    """npugraph_ex's ``torch.compile`` backend under ``config``, after ``torch._dynamo.reset()``; the next graph is
    named as the first of a fresh process. Run only in a process set up by :func:`install`. ``config`` is taken as
    given: this library's own (:func:`functional_npu.runtime.serving.backends.npugraph_ex_config`) was checked when
    it was made; ``decompositions``: its ``custom_decompositions`` (the library's backend passes the invariant ops',
    :func:`functional_npu.models.invariant_ops.decompositions`)."""
    import npugraph_ex  # type: ignore[import-not-found]
    from npugraph_ex import npu_fx_compiler  # type: ignore[import-not-found]
    from npugraph_ex._acl_concrete_graph import graph_pass, replace_stream_event  # type: ignore[import-not-found]

    torch._dynamo.reset()
    # each graph as the first of a fresh process: npugraph_ex names its events after a per-process graph counter
    npu_fx_compiler._GLOBAL_GRAPH_ID = 0
    replace_stream_event.GraphCounter.set_graph_id(-1)
    graph_pass._GLOBAL_SCOPE_TAG_TO_EVENT.clear()
    # its fusion patterns replace matches with torch_npu's own ops (torch.ops.npu.npu_add_rms_norm, ...,
    # npu_transpose_batchmatmul), which need torch_npu's native op library: not run here (see PASSES_NOT_RUN)
    config.pattern_fusion_pass = False
    return npugraph_ex.get_npu_backend(compiler_config=config, custom_decompositions=decompositions or {})


def capture(fn: Any, args: tuple[Any, ...], config: Any, decompositions: dict | None = None) -> dict[str, Any]:
    """Compile ``fn(*args)`` with npugraph_ex's backend under ``config`` (this library's:
    :func:`functional_npu.runtime.serving.backends.npugraph_ex_config`) and ``decompositions`` (:func:`backend`), and
    return what it hands to capture (see :func:`handed`). Run only in a process set up by :func:`install`."""
    compiled = torch.compile(fn, backend=backend(config, decompositions), fullgraph=True, dynamic=False)
    before = len(_HANDED)
    try:
        with torch.no_grad():
            compiled(*args)
    except Exception as e:  # noqa: BLE001 - dynamo wraps the stand-in's stop in its own errors
        if len(_HANDED) == before:
            raise
        if not any(isinstance(c, HandedToCapture) for c in _chain(e)):
            raise
    got = _HANDED[before:]
    if len(got) != 1:
        raise RuntimeError(f"expected one graph handed to capture, got {len(got)}")
    return got[0]


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return out


# ---- capture order ------------------------------------------------------------------------------
@dataclass
class CaptureOrder:
    """The captured ops in capture order, each with its stream, and the event edges between streams.

    ``ops``: node names (every ``call_function`` node but scope markers and event ops, which become edges);
    ``stream``: node -> stream (``main`` or the ``_user_stream_label``); ``events``: (recording node or the
    graph's start, waiting node, tag) for every event wait, recorded last before it in capture order;
    ``nodes``: name -> FX node.
    """

    ops: list[str]
    stream: dict[str, str]
    events: list[tuple[str, str, str]]
    unmatched: list[str] = field(default_factory=list)  # event waits with no record before them
    nodes: dict[str, torch.fx.Node] = field(default_factory=dict, repr=False)


def _label(node: torch.fx.Node) -> str | None:
    keys, values = node.args[0], node.args[1]
    return dict(zip(keys, values)).get("_user_stream_label")


def capture_order(gm: torch.fx.GraphModule) -> CaptureOrder:
    """Capture order as npugraph_ex's generated forward executes ``gm`` (``_codegen_fx_forward``,
    ``fx2acl_converter.py:672``): node by node; after a ``scope_enter`` with a ``_user_stream_label`` the ops
    run under that label's stream until its ``scope_exit``; a tagged event records on (or waits on) the
    current stream, or the named one."""
    stack: list[str | None] = []
    ops: list[str] = []
    stream: dict[str, str] = {}
    events: list[tuple[str, str, str]] = []
    unmatched: list[str] = []
    last_record: dict[str, tuple[str, str]] = {}  # tag -> (op after which it was recorded, stream)
    last_on: dict[str, str] = {}  # stream -> its last op
    nodes: dict[str, torch.fx.Node] = {}

    def current() -> str:
        labels = [s for s in stack if s is not None]
        return labels[-1] if labels else MAIN

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target)
        if target == SCOPE_ENTER:
            stack.append(_label(node))
            continue
        if target == SCOPE_EXIT:
            if stack:
                stack.pop()
            continue
        s = current()
        if target in (RECORD, RECORD_ON):
            on = s if target == RECORD else f"stream_id_{node.args[1]}"
            # an event recorded on a stream with no op yet marks the graph's start on it
            last_record[node.args[0]] = (last_on.get(on, f"start:{on}"), on)
            continue
        if target in (WAIT, WAIT_ON):
            on = s if target == WAIT else f"stream_id_{node.args[1]}"
            if node.args[0] not in last_record:
                unmatched.append(f"{node.name} waits for {node.args[0]}, not recorded before it")
                continue
            src, _ = last_record[node.args[0]]
            events.append((src, f"wait@{node.name}", node.args[0]))
            ops.append(f"wait@{node.name}")
            stream[f"wait@{node.name}"] = on
            last_on[on] = f"wait@{node.name}"
            continue
        ops.append(node.name)
        stream[node.name] = s
        nodes[node.name] = node
        last_on[s] = node.name
    return CaptureOrder(ops, stream, events, unmatched, nodes)


def _base(node: Any) -> Any:
    """The placeholder (or allocating node) a view chain starts from."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args and _is_view(node):
        node = node.args[0]
    return node


def _is_view(node: torch.fx.Node) -> bool:
    t = node.target
    if t is operator.getitem:
        return False
    schema = getattr(t, "_schema", None)
    if schema is None:
        return False
    return any(_alias(r) for r in schema.returns)


def _alias(ret: Any) -> bool:
    """A return that aliases an input without writing it (``Tensor(a)``, or ``Tensor(a)[]`` as ``split`` returns)."""
    info = ret.alias_info
    if info is None and str(ret.type).endswith("[]"):
        return "(a" in str(ret)  # the list's element carries the alias set
    return info is not None and not info.is_write


def _bytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0


def edges(order: CaptureOrder, *, data_edges: bool = False) -> dict[str, list[str]]:
    """Each op's direct predecessors in a captured graph: the previous op on its stream and, for an event wait, the op
    after which the event was recorded (none when recorded before any op of its stream); with ``data_edges`` also
    the ops whose values it reads (see :func:`program`)."""
    after: dict[str, list[str]] = {}
    prev: dict[str, str] = {}
    record_of = {w: src for src, w, _ in order.events}
    for op in order.ops:
        s = order.stream[op]
        deps = [prev[s]] if s in prev else []
        src = record_of.get(op)
        if src is not None and not src.startswith("start:"):
            deps.append(src)
        node = order.nodes.get(op)
        if data_edges and node is not None:
            deps += [a.name for a in node.all_input_nodes if a.name in order.stream]
        after[op] = sorted(set(deps))
        prev[s] = op
    return after


def program(
    order: CaptureOrder, k: int, *, data_edges: bool = False, phase: int = 0
) -> tuple[hazard.Program, dict[str, Any]]:
    """The :class:`~functional_npu.checks.hazard.Program` of a capture order, and what it found about the ring.

    ``after``: the previous op on the same stream, and for an event wait the op after which the event was
    recorded. Data edges between streams order nothing in a captured graph; with ``data_edges`` they are
    added too (what a compiler that synchronizes streams on data, as inductor does, would give).
    A *write* is a ``functional_npu.broadcast_into`` (its slot: the graph input its first argument views);
    its *wait* the ``wait_tensor`` of that slot, a *read* any other op that uses the waited slot (through
    views); an *alloc* a broadcast into memory the graph creates. A slot is bound by its input index (its place
    in the ring, ``phase`` the schedule's, :func:`functional_npu.checks.hazard.bind`); a read means the layer of
    the compute that uses it, read off the per-layer inputs named by each placeholder's ``meta["input_path"]``
    (:func:`functional_npu.checks.hazard_fx.fx_read_layers`; none named: no read names a layer).
    """
    from ..checks.hazard_fx import fx_bind, fx_read_layers, fx_ring

    ops = list(order.ops)
    after = edges(order, data_edges=data_edges)
    graph = next(iter(order.nodes.values())).graph if order.nodes else torch.fx.Graph()
    writes: dict[str, tuple[str, int]] = {}  # in capture order
    waits: dict[str, str] = {}
    allocs: dict[str, int] = {}
    slots = {n.name: _bytes(n) for n in fx_ring(graph)}  # slot placeholder -> bytes
    waited: dict[str, tuple[str, str]] = {}  # node whose value is a waited slot (or a view of one) -> (slot, wait)
    read_of: dict[str, tuple[str, str]] = {}  # read -> (slot, the wait whose value it reads)
    for op in ops:  # the ring: every graph input a broadcast writes (a read of one may come before any write)
        node = order.nodes.get(op)
        if node is not None and str(node.target) == BROADCAST_INTO and _base(node.args[0]).op == "placeholder":
            slots[_base(node.args[0]).name] = _bytes(_base(node.args[0]))
    groups = max(1, len(slots) // (k + 1))
    for op in ops:
        node = order.nodes.get(op)
        if node is None:
            continue
        if str(node.target) == BROADCAST_INTO:
            base = _base(node.args[0])
            if base.op == "placeholder":
                slots[base.name] = _bytes(base)
            else:
                allocs[op] = _bytes(base)
            writes[op] = (base.name, -1)
            continue
        if str(node.target) == WAIT_TENSOR and _base(node.args[0]).name in slots:
            waits[op] = _base(node.args[0]).name
            waited[op] = (waits[op], op)
            continue
        used = {waited[a.name] for a in node.all_input_nodes if a.name in waited}
        if used and (_is_view(node) or node.target is operator.getitem):
            waited[op] = next(iter(used))
            continue
        if used:
            read_of[op] = next(iter(used))
    layers = fx_read_layers(graph, {r: w for r, (_, w) in read_of.items()}, set(slots) | set(writes) | set(waited))
    reads = {r: (slot, layers.get(r)) for r, (slot, _) in read_of.items()}
    for j, op in enumerate(list(writes)):
        writes[op] = (writes[op][0], k + j // groups)
    slot_index, initial = fx_bind(graph, list(slots), k, groups, phase)
    prog = hazard.Program(ops, after, writes, waits, reads, allocs, initial, slot_index, phase)
    return prog, {"slots": slots, "groups": groups, "allocs": allocs}


def _concurrent(prog: hazard.Program, k: int) -> list[str]:
    """With ``k >= 1``: every broadcast whose layer is read is unordered (neither before nor after) with at least
    one read of an earlier layer, i.e. it can run while the compute of an earlier layer does."""
    if k < 1:
        return []
    index = {op: i for i, op in enumerate(prog.ops)}
    anc = hazard.ancestors(prog)

    def before(a: str, b: str) -> bool:
        return bool(anc[b] >> index[a] & 1)

    out = []
    by_slot: dict[str, list[str]] = {}
    for w, (slot, _) in prog.writes.items():
        by_slot.setdefault(slot, []).append(w)
    layer: dict[str, int] = {}
    for r, (slot, _) in prog.reads.items():
        ws = [w for w in by_slot.get(slot, []) if before(w, r)]
        layer[r] = prog.writes[max(ws, key=index.__getitem__)][1] if ws else prog.initial.get(slot, -1)
    for w, (_, v) in prog.writes.items():
        if not any(lay == v for lay in layer.values()):
            continue  # the next step's layer: read in the next graph
        if not any(lay < v and not before(r, w) and not before(w, r) for r, lay in layer.items()):
            out.append(f"concurrency: {w} (layer {v}) is ordered with every read of every earlier layer")
    return out


def prefetch_report(
    gm: torch.fx.GraphModule, k: int, ring_bytes: int | None = None, *, phase: int = 0
) -> dict[str, Any]:
    """The ring's findings over npugraph_ex's capture order (a step of ring phase ``phase``): hazard violations
    (:func:`functional_npu.checks.hazard.check`, plus :func:`_concurrent`), slots, bytes, streams."""
    order = capture_order(gm)
    prog, found = program(order, k, phase=phase)
    problems = hazard.check(prog, k, slots=(k + 1) * found["groups"]) + _concurrent(prog, k)
    problems += [f"event: {u}" for u in order.unmatched]
    side = sorted({order.stream[w] for w in prog.writes})
    if len(side) != 1 or side == [MAIN]:
        problems.append(f"streams: the broadcasts run on {side}, not one side stream")
    return {
        "ok": not problems,
        "problems": problems,
        "k": k,
        "ring_slots": len(found["slots"]),
        "ring_bytes": sum(found["slots"].values()),
        "allocated_prefetch_bytes": sum(found["allocs"].values()),
        "broadcasts": len(prog.writes),
        "broadcast_streams": side,
        "waits": len(prog.waits),
        "reads": len(prog.reads),
        "events": len(order.events),
    }


def streams_summary(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """Ops per stream in capture order (op targets), and the event edges (tag, from, to)."""
    order = capture_order(gm)
    per: dict[str, list[str]] = {}
    for op in order.ops:
        node = order.nodes.get(op)
        per.setdefault(order.stream[op], []).append(
            f"{op}: {node.target}" if node is not None else f"{op}: tagged_event_wait"
        )
    return {
        "streams": per,
        "events": [{"tag": tag, "record_after": src, "wait": dst} for src, dst, tag in order.events],
        "unmatched": order.unmatched,
    }


class _ScopeOnly:
    """npugraph_ex's stream scope with no event on entry (the control: streams, no ordering between them)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __enter__(self) -> None:
        from npugraph_ex.scope._scope import _npu_scope_enter  # type: ignore[import-not-found]

        _npu_scope_enter([("_user_stream_label", self.tag), ("_user_stream_priority", "0")])

    def __exit__(self, *_: Any) -> None:
        from npugraph_ex.scope._scope import _npu_scope_exit  # type: ignore[import-not-found]

        _npu_scope_exit()


def unordered_streams() -> Any:
    """The no-hints control: the broadcasts on npugraph_ex's side stream, with no events (and no ``after``)."""
    from ..parallel.streams import INLINE, Streams

    return Streams("npugraph_ex-no-events", _ScopeOnly, INLINE.after, gate=False)
