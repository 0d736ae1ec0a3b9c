"""What ACL graph capture needs of a graph, checked on the FX graph npugraph_ex would capture, before any device.

Each check takes the graph after npugraph_ex's passes (:func:`functional_npu.npu.acl_graph.capture`; the golden
``acl_graph.txt``) and returns a list of problems, one line each (empty: it passes). Stream order is read as
:func:`functional_npu.npu.acl_graph.capture_order` reads it: one stream per ``_user_stream_label`` scope, the capture
stream (``main``) elsewhere; an op happens before another when a chain of same-stream order and event record -> wait
edges leads from it to the other (:func:`functional_npu.npu.acl_graph.edges`).

- :func:`unjoined_streams`: every side stream is joined back to the capture stream before the graph ends: its last
  op happens before the capture stream's last op. ACL capture refuses a graph with a stream forked off the capture
  stream and not joined back: ``aclmdlRICaptureEnd`` fails with error 107025, "capture model contains a stream that
  was not joined to the original stream" (vllm-ascend issue 13792).
- :func:`copies`: no host <-> device transfer, no copy of a graph input and no buffer for a collective allocated
  inside the captured region. A synchronous memcpy during capture fails with error 107030, "the current capture
  mode does not support this operation" (vllm-ascend issue 6002). Allowed, precisely: every op that computes a new
  value, including ``clone`` and ``_to_copy`` of an intermediate (a layout or dtype change of an activation is
  compute); ``_to_copy`` of a graph input that changes its dtype (a cast); a ``copy_`` of a computed value into a
  graph input that no collective writes (the model's own state write, as Gemma 3's sliding-window KV cache stores
  its window); and allocations (``empty``, ``zeros``, ``full``, ...; npugraph_ex's own static workspaces are
  ``torch.empty``) that no collective writes. Refused: any op whose result lies on another device than the graph's
  inputs, ``.item()`` (``_local_scalar_dense``), a ``copy_`` across devices; ``clone`` / ``copy`` /
  ``lift_fresh_copy`` / a same-dtype ``_to_copy`` of a graph input (through views) and a ``copy_`` from one (an
  input is used where it lies: a ring slot, a cache, a weight); a ``copy_`` into a ring slot (an input a collective
  writes) or into an input from a buffer a collective wrote (the copy back of a slot cloned for its broadcast), or
  into an input from a functional write (``scatter``, ``index_put``, ...) of a view of the same input (a KV write
  npugraph_ex did not turn back in place: the whole cache or pool copied each replay; a paged cache's write through a
  flattened view of its pool did this, an ``index_put_`` on the pool does not); an
  ``auto_functionalized`` op left on a graph input (it writes a copy of the input: npugraph_ex did not reinplace
  it); an allocation a collective writes (a prefetch buffer is the ring, a graph input).
- :func:`concurrent_comm`: the communication ops (collectives and the ring's broadcasts) and how many streams run
  them at once; :func:`comm_problems` against a :class:`CommBudget`. The rule is npugraph_ex's ``deadlock_check``
  (``tools/aclgraph_check/deadlock_check.py``): two communication kernels on different streams that may run at once
  (neither happens before the other), each taking ``Numblocks`` vector cores at once (``Schem Mode`` 1: HCCL's AIV
  kernels, names ``aiv_*``, and MoE dispatch / combine), deadlock when their vector cores sum to more than the
  device has. How many cores an AIV collective takes a device trace shows; ``deadlock_check``'s own example takes
  them all (``aiv_all_gather_bfloat16_t``, 48 of 48), so the budget assumes that: one communication stream at a time.
  :func:`deadlock_trace` writes a capture order in the trace format ``deadlock_check`` reads, so its own functions
  can be run on it.
- the recapture count over replays is :func:`functional_npu.npu.acl_replay.recapture_problems`.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..checks import hazard
from ..core.collectives import BROADCAST_INTO
from .acl_graph import MAIN, WAIT_TENSOR, CaptureOrder, capture_order, edges

__all__ = [
    "unjoined_streams",
    "copies",
    "CommBudget",
    "COMM_BUDGETS",
    "concurrent_comm",
    "comm_problems",
    "deadlock_trace",
]

# allocations that make memory and nothing else (npugraph_ex makes its static workspaces with ``torch.empty``)
ALLOCATIONS = {
    f"aten.{op}.{overload}"
    for op, overload in (
        ("empty", "memory_format"),
        ("empty_like", "default"),
        ("empty_strided", "default"),
        ("new_empty", "default"),
        ("new_empty_strided", "default"),
        ("zeros", "default"),
        ("zeros_like", "default"),
        ("new_zeros", "default"),
        ("ones", "default"),
        ("ones_like", "default"),
        ("new_ones", "default"),
        ("full", "default"),
        ("full_like", "default"),
        ("new_full", "default"),
    )
} | {"<built-in method empty of type object>", "<built-in method empty of type>"}
COPIES = {"aten.clone.default", "aten.copy.default", "aten.lift_fresh_copy.default", "aten._to_copy.default"}
COPY_INTO = "aten.copy_.default"
# functional forms of the in-place writes a cache takes (npugraph_ex turns them back in place on a graph input)
FUNCTIONAL_WRITES = {
    "aten.scatter.src",
    "aten.scatter.value",
    "aten.index_put.default",
    "aten.index_copy.default",
    "aten.slice_scatter.default",
    "aten.select_scatter.default",
}
FUNCTIONALIZED = ("auto_functionalized", "auto_functionalized_v2")
WRITTEN = "(written in place by the graph: a ring slot or a cache)"
WHERE_IT_LIES = "an input is used where it lies"
BROADCAST_ONLY = "a ring slot is written by its broadcast only"
IN_CAPTURE = "inside the captured region (a synchronous memcpy in capture fails with 107030)"
TO_HOST = {"aten._local_scalar_dense.default": "reads a device value on the host (.item())"}
# communication ops: collectives (torch's functional ones, npugraph_ex's npu_define ones) and the ring's broadcasts
COMM_NAMESPACES = ("_c10d_functional.", "c10d.", "npu_define.")


# ---- joins --------------------------------------------------------------------------------------------------------
def _ancestors(order: CaptureOrder) -> tuple[dict[str, int], dict[str, int]]:
    prog = hazard.Program(order.ops, edges(order))
    return hazard.ancestors(prog), {op: i for i, op in enumerate(order.ops)}


def unjoined_streams(gm: torch.fx.GraphModule) -> list[str]:
    """The side streams not joined back to the capture stream before the graph ends (see the module docstring)."""
    order = capture_order(gm)
    anc, index = _ancestors(order)
    last: dict[str, str] = {}
    for op in order.ops:
        last[order.stream[op]] = op
    end = last.get(MAIN)
    out = []
    for s, op in sorted(last.items()):
        if s == MAIN or (end is not None and anc[end] >> index[op] & 1):
            continue
        out.append(
            f"join: stream {s!r} is not joined to the capture stream before the graph ends: no event recorded after "
            f"its last op {op} is waited on {MAIN!r} (ACL capture fails with 107025, a stream not joined to the "
            "original stream)"
        )
    return out


# ---- copies -------------------------------------------------------------------------------------------------------
def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _base(node: Any) -> Any:
    """The node a chain of views starts from (a placeholder, when the value views a graph input)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if node.target is operator.getitem:
            node = node.args[0]
            if isinstance(node, torch.fx.Node) and _views(node):
                continue
            return node
        if schema is None or not _views(node):
            return node
        node = node.args[0]
    return node


def _views(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    return any(
        (r.alias_info is not None and not r.alias_info.is_write)
        or (r.alias_info is None and str(r.type).endswith("[]") and "(a" in str(r))
        for r in schema.returns
    )


def _written(node: torch.fx.Node) -> list[Any]:
    """The arguments ``node`` writes in place (its schema's ``Tensor(a!)`` arguments)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            out += list(value) if isinstance(value, (list, tuple)) else [value]
    return [v for v in out if isinstance(v, torch.fx.Node)]


def _is_comm(node: torch.fx.Node) -> bool:
    return _is_comm_target(str(node.target))


def _is_comm_target(target: str) -> bool:
    return (target.startswith(COMM_NAMESPACES) and target != WAIT_TENSOR) or target == BROADCAST_INTO


def _device(gm: torch.fx.GraphModule) -> torch.device | None:
    """The device of most of the graph's tensor inputs."""
    got = Counter(v.device for n in gm.graph.nodes if n.op == "placeholder" for v in [_val(n)] if _is_tensor(v))
    return got.most_common(1)[0][0] if got else None


def _is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def _functionalized(node: torch.fx.Node) -> tuple[Any, list[Any]] | None:
    """``(op, bases)`` of an ``auto_functionalized`` / ``auto_functionalized_v2`` node: the in-place op it runs on
    copies of ``bases`` (what is left of an in-place op npugraph_ex did not reinplace)."""
    if str(node.target) not in FUNCTIONALIZED or not node.args:
        return None
    op = node.args[0]
    if "_all_bases" in node.kwargs:
        return op, list(node.kwargs["_all_bases"])
    schema = getattr(op, "_schema", None)
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] if schema else []
    bases = [node.kwargs[name] for name in written if name in node.kwargs]
    return op, [b for v in bases for b in (v if isinstance(v, (list, tuple)) else [v])]


@dataclass
class _Writes:
    """What a graph writes in place: the nodes written (bases of views), and those a communication op writes."""

    mutated: set[str]
    comm: dict[str, str]  # base node -> the communication op that writes it

    def input_of(self, arg: Any) -> str | None:
        """The graph input ``arg`` views (its name, marked when the graph writes it), or None."""
        base = _base(arg)
        if isinstance(base, torch.fx.Node) and base.op == "placeholder":
            return base.name + (f" {WRITTEN}" if base.name in self.mutated else "")
        return None


def _writes(gm: torch.fx.GraphModule) -> _Writes:
    mutated = {b.name for n in gm.graph.nodes if n.op == "call_function" for w in _written(n) for b in [_base(w)]}
    comm: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        functionalized = _functionalized(n)
        if functionalized is not None:
            mutated |= {_base(b).name for b in functionalized[1] if isinstance(b, torch.fx.Node)}
            if isinstance(functionalized[0], torch._ops.OpOverload) and _is_comm_target(str(functionalized[0])):
                for b in functionalized[1]:
                    comm.setdefault(_base(b).name, n.name)
        elif _is_comm(n):
            for w in _written(n):
                comm.setdefault(_base(w).name, n.name)
    return _Writes(mutated, comm)


def copies(gm: torch.fx.GraphModule) -> list[str]:
    """Host <-> device transfers, copies of graph inputs and buffers for collectives made inside the graph (see the
    module docstring for what is allowed)."""
    device, writes = _device(gm), _writes(gm)
    out: list[str] = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out += _copy_problems(n, device, writes)
    return out


def _copy_problems(n: torch.fx.Node, device: torch.device | None, writes: _Writes) -> list[str]:
    target, val = str(n.target), _val(n)
    if target in TO_HOST:
        return [f"transfer: {n.name} ({target}) {TO_HOST[target]} inside the captured region"]
    if device is not None and _is_tensor(val) and val.device != device:
        return [f"transfer: {n.name} ({target}) puts a value on {val.device}, not {device}, {IN_CAPTURE}"]
    functionalized = _functionalized(n)
    if functionalized is not None:
        inputs = [name for b in functionalized[1] for name in [writes.input_of(b)] if name is not None]
        if not inputs:
            return []
        return [
            f"copy: {n.name} ({target} of {functionalized[0]}) copies graph input {', '.join(inputs)} to write the "
            "copy: npugraph_ex did not reinplace it"
        ]
    if target == COPY_INTO:
        return _copy_into_problems(n, writes)
    if target in COPIES and n.args:
        name, source = writes.input_of(n.args[0]), _val(n.args[0])
        cast = target == "aten._to_copy.default" and _is_tensor(source) and _is_tensor(val)
        if name is not None and not (cast and val.dtype != source.dtype):
            return [f"copy: {n.name} ({target}) copies graph input {name}: {WHERE_IT_LIES}"]
        return []
    if target in ALLOCATIONS and n.name in writes.comm:
        return [
            f"alloc: {n.name} ({target}) allocates the buffer {writes.comm[n.name]} writes inside the captured region: "
            "a prefetch buffer is the ring, a graph input"
        ]
    return []


def _copy_into_problems(n: torch.fx.Node, writes: _Writes) -> list[str]:
    """``copy_(dst, src)``: across devices, from a graph input, or into a ring slot (or from what a collective wrote
    into an input)."""
    target, (dst, src) = str(n.target), n.args[:2]
    if _is_tensor(_val(dst)) and _is_tensor(_val(src)) and _val(dst).device != _val(src).device:
        return [f"transfer: {n.name} ({target}) copies from {_val(src).device} to {_val(dst).device} {IN_CAPTURE}"]
    out = []
    name, into = writes.input_of(src), writes.input_of(dst)
    if name is not None:
        out.append(f"copy: {n.name} ({target}) copies from graph input {name}: {WHERE_IT_LIES}")
    if into is not None and _base(dst).name in writes.comm:
        out.append(
            f"copy: {n.name} ({target}) copies into graph input {into}, which {writes.comm[_base(dst).name]} writes: "
            f"{BROADCAST_ONLY}"
        )
    elif into is not None and _base(src).name in writes.comm:
        out.append(
            f"copy: {n.name} ({target}) copies into graph input {into} what {writes.comm[_base(src).name]} wrote: "
            f"{BROADCAST_ONLY}"
        )
    elif into is not None:
        out += _write_back(n, dst, src)
    return out


def _write_back(n: torch.fx.Node, dst: Any, src: Any) -> list[str]:
    """``copy_(input, write(view of input, ...))``: a functional write into a graph input left unreinplaced, its
    result copied back whole (a paged KV write through a flattened view of the pool does this)."""
    made = _base(src)
    if not (isinstance(made, torch.fx.Node) and str(made.target) in FUNCTIONAL_WRITES and made.args):
        return []
    if _base(made.args[0]) is not _base(dst):
        return []
    return [
        f"copy: {n.name} ({COPY_INTO}) writes graph input {_base(dst).name} back whole from {made.name} "
        f"({made.target}): npugraph_ex did not reinplace the write, a copy of the whole input each replay"
    ]


# ---- communication streams ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommBudget:
    """How many streams may run communication kernels at once on a device (npugraph_ex's ``deadlock_check`` rule):
    ``vector_cores // collective_cores``, at least one. ``collective_cores``: the vector cores one AIV communication
    kernel may hold at once."""

    device: str
    vector_cores: int
    collective_cores: int
    source: str = ""

    @property
    def streams(self) -> int:
        return max(1, self.vector_cores // self.collective_cores)


COMM_BUDGETS: dict[str, CommBudget] = {
    "ascend-910b": CommBudget(
        "ascend-910b",
        40,
        40,
        "Atlas A2: 2 vector cores per cube core, 24 cube cores on a 910B2 (48 vector), 20 on a 910B3 / 910B4 (40): "
        "the smaller; an AIV collective may hold them all (deadlock_check's aiv_all_gather_bfloat16_t: 48 of 48)",
    ),
    "ascend-910c": CommBudget(
        "ascend-910c",
        48,
        48,
        "one die (a device): 24 cube and 48 vector cores, deadlock_check's stated hardware; an AIV collective may "
        "hold them all",
    ),
}


def concurrent_comm(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """The graph's communication ops per stream (in capture order) and the most streams that may run them at once:
    ``{"streams": {stream: [op, ...]}, "max_concurrent": n, "at_once": [op, ...]}`` (``at_once``: one set of that many
    ops on distinct streams, none happening before another)."""
    order = capture_order(gm)
    anc, index = _ancestors(order)
    per: dict[str, list[str]] = {}
    for op in order.ops:
        node = order.nodes.get(op)
        if node is not None and _is_comm(node):
            per.setdefault(order.stream[op], []).append(op)

    def apart(a: str, b: str) -> bool:
        return not (anc[b] >> index[a] & 1) and not (anc[a] >> index[b] & 1)

    best: list[str] = [ops[0] for ops in per.values()][:1]
    streams = sorted(per)
    for size in range(len(streams), 1, -1):
        if len(best) >= size:
            break
        for chosen in itertools.combinations(streams, size):
            found = _antichain([per[s] for s in chosen], apart, [])
            if found:
                best = found
                break
    return {"streams": per, "max_concurrent": len(best), "at_once": best}


def _antichain(groups: list[list[str]], apart: Any, picked: list[str]) -> list[str] | None:
    if not groups:
        return picked
    for op in groups[0]:
        if all(apart(op, p) for p in picked):
            got = _antichain(groups[1:], apart, picked + [op])
            if got:
                return got
    return None


def comm_problems(gm: torch.fx.GraphModule, budget: CommBudget) -> list[str]:
    """One line when more streams than ``budget.streams`` may run communication kernels at once."""
    got = concurrent_comm(gm)
    if got["max_concurrent"] <= budget.streams:
        return []
    order = capture_order(gm)
    at_once = ", ".join(f"{op} on {order.stream[op]!r}" for op in got["at_once"])
    return [
        f"comm: {got['max_concurrent']} streams may run communication at once ({at_once}); {budget.device} allows "
        f"{budget.streams} ({budget.vector_cores} vector cores, an AIV collective may hold {budget.collective_cores}): "
        "concurrent AIV collectives over the device's vector cores deadlock (npugraph_ex's deadlock_check)"
    ]


def deadlock_trace(gm: torch.fx.GraphModule, collective_cores: int) -> list[dict[str, Any]]:
    """The graph's capture order as the Chrome-trace tasks npugraph_ex's ``deadlock_check`` reads: one ``tid`` per
    stream; each op a task, a communication op an ``aiv_<op>`` ``KERNEL_AIVEC`` of ``collective_cores`` blocks in
    ``Schem Mode`` 1; each event record -> wait edge an ``EVENT_RECORD_<h>`` task after the recording op and an
    ``EVENT_WAIT_<h>`` task at the wait."""
    order = capture_order(gm)
    tid = {s: f"stream{i}" for i, s in enumerate([MAIN] + sorted(set(order.stream.values()) - {MAIN}))}
    per: dict[str, list[dict[str, Any]]] = {t: [] for t in tid.values()}
    handle = {w: h for h, (_, w, _) in enumerate(order.events, start=1)}
    records: dict[str, list[int]] = {}
    for src, w, _ in order.events:
        records.setdefault(src, []).append(handle[w])

    def task(stream: str, name: str, **args: Any) -> None:
        per[tid[stream]].append({"ph": "X", "tid": tid[stream], "name": name, "args": args})

    for s in tid:
        for h in records.get(f"start:{s}", []):
            task(s, f"EVENT_RECORD_{h}", **{"Task Type": "EVENT_RECORD"})
    for op in order.ops:
        s = order.stream[op]
        node = order.nodes.get(op)
        if op in handle:
            task(s, f"EVENT_WAIT_{handle[op]}", **{"Task Type": "EVENT_WAIT"})
        elif node is not None and _is_comm(node):
            task(s, f"aiv_{op}", **{"Task Type": "KERNEL_AIVEC", "Numblocks": collective_cores, "Schem Mode": 1})
        else:
            task(s, op, **{"Task Type": "KERNEL_AICORE"})
        for h in records.get(op, []):
            task(s, f"EVENT_RECORD_{h}", **{"Task Type": "EVENT_RECORD"})
    out = []
    for tasks in per.values():
        for i, t in enumerate(tasks):
            t["args"]["Task Id"] = i
            out.append(t)
    return out
