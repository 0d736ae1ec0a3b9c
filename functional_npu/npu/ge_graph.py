"""What a converted GE graph says, read from the graph itself.

:func:`records` turns a GE ``GraphDef`` (torchair's protobuf message) into plain op records, and
:func:`records_from_text` a stored one (its protobuf text format, ``ge_graph.pbtxt``) into the same records; all
else here works on those records, so it needs neither torchair nor protobuf:

- :func:`census`: GE op type -> count;
- :func:`hcom_schedule`: the ordered Hcom ops (``HcomAllReduce``, ``HcomBroadcast``, ...) with their
  group's ranks and mesh axis, bytes, root and stream;
- :func:`ring_program` / :func:`ring_check`: the prefetch ring (graph inputs written in place by
  ``HcomBroadcast``, and by the owner's ``ViewCopy`` of its parts) as a
  :class:`functional_npu.checks.hazard.Program` over the graph's **partial order** (data and control
  edges; GE may run any order they allow), each slot bound to the schedule by its input index and each read to
  the layer of its compute, checked for write after read, read before write, write after write, the right
  layer, overlap, the slot bound and any prefetch buffer allocated inside the graph;
- :func:`cache_writes`: how a paged KV cache's pools are written: ``ScatterNdUpdate`` on the pool's own ``RefData``
  input (in place, the write Ascend serving's graphs make) or on a ``TensorMove`` copy of it (a copy of the pool per
  write);

Allocation is counted from the op that creates the memory: a broadcast whose buffer is not a graph
input (a ``Fill``, a ``ConcatV2``) allocates inside the graph, whatever edges gate the broadcast.
"""

from __future__ import annotations

import codecs
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "records",
    "records_from_text",
    "parse_pbtxt",
    "census",
    "hcom_schedule",
    "HCOM_OF",
    "ring_program",
    "ring_check",
    "cache_writes",
]

Op = dict[str, Any]

HCOM_OF = {  # aten functional collective -> the GE op torchair converts it to
    "all_reduce": "HcomAllReduce",
    "all_gather_into_tensor": "HcomAllGather",
    "reduce_scatter_tensor": "HcomReduceScatter",
    "all_to_all_single": "HcomAllToAllV",
    "broadcast": "HcomBroadcast",
    "broadcast_into": "HcomBroadcast",  # functional_npu's in-place broadcast into a prefetch ring slot
}
_ITEMSIZE = {"DT_FLOAT": 4, "DT_FLOAT16": 2, "DT_BF16": 2, "DT_INT64": 8, "DT_INT32": 4, "DT_INT8": 1, "DT_BOOL": 1}
# ops a buffer's value passes through to its uses; the splits that unpack a coalesced buffer count too, so
# the buffer stays live until the last use of any part (GE may alias the parts, or copy them)
_VIEWS = {
    "Identity",
    "Reshape",
    "Transpose",
    "Unsqueeze",
    "Squeeze",
    "ExpandDims",
    "TransData",
    "SplitV",
    "SplitVD",
    "Split",
    "SplitD",
    "Slice",
    "StridedSlice",
    "StridedSliceV2",
}
_WAIT = "_c10d_functional.wait_tensor"
_RING_WRITE = "functional_npu.ring_write"  # the FX op torchair converts a ring write from (its value's name)
_SHAPE = re.compile(r"shape=torch\.Size\(\[([^\]]*)\]\)")


def _desc(desc: Any, dtype_name: Any) -> dict[str, Any]:
    """dtype name, shape (from torchair's ``_meta`` note, GE infers the rest) and the FX value's name."""
    attrs = desc.attr
    meta = attrs["_meta"].s.decode() if "_meta" in attrs else ""
    found = _SHAPE.search(meta)
    if found:
        shape = [int(d) for d in found.group(1).split(",") if d.strip()]
    else:
        shape = list(desc.shape.dim)
    fx = attrs["_fx_tensor_name"].s.decode() if "_fx_tensor_name" in attrs else ""
    return {"dtype": dtype_name(desc.dtype), "shape": shape, "fx": fx}


_TRANSPOSES = ("transpose_x1", "transpose_x2", "adj_x1", "adj_x2")  # MatMul's, BatchMatMul's


def records(graph: Any, dtype_name: Any = str) -> list[Op]:
    """Plain records of a GE ``GraphDef``'s ops, in graph order.

    Each is ``{"name", "type", "inputs": [op names], "controls": [op names], "stream", "attrs": {group,
    root_rank, reduction, index (a graph input's), a matmul's transpose_x1 / transpose_x2 / adj_x1 / adj_x2; when
    present}, "in": [desc], "out": [desc]}`` with ``desc = {"dtype", "shape", "fx"}``. ``dtype_name`` maps GE's
    dtype enum to its name (``DataType.Name``).
    """
    out = []
    for op in graph.op:
        data, controls = [], []
        for src in op.input:
            if not src:
                continue  # an absent optional input
            name, _, index = src.rpartition(":")
            (controls if index == "-1" else data).append(name)
        attrs = {}
        for key in ("group", "reduction"):
            if key in op.attr:
                attrs[key] = op.attr[key].s.decode()
        for key in ("root_rank", "index"):
            if key in op.attr:
                attrs[key] = op.attr[key].i
        for key in _TRANSPOSES:
            if key in op.attr:
                attrs[key] = op.attr[key].b
        stream = op.attr["_user_stream_label"].s.decode() if "_user_stream_label" in op.attr else None
        out.append(
            {
                "name": op.name,
                "type": op.type,
                "inputs": data,
                "controls": controls,
                "stream": stream,
                "attrs": attrs,
                "in": [_desc(d, dtype_name) for d in op.input_desc],
                "out": [_desc(d, dtype_name) for d in op.output_desc],
            }
        )
    return out


_PB_TOKEN = re.compile(r'\s+|#[^\n]*|"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[{}:<>\[\],;]|[^\s{}:<>\[\],;"\']+')


def parse_pbtxt(text: str) -> dict[str, list[Any]]:
    """A protobuf message in text format, without its schema: field name -> the list of its values (a nested
    message as a dict of the same kind, a string as ``str``, a number as ``int``/``float``, anything else -- an
    enum, a bool -- as the bare word)."""
    tokens = [t for t in _PB_TOKEN.findall(text) if t.strip() and not t.startswith("#")]
    pos = 0

    def message(end: str | None) -> dict[str, list[Any]]:
        nonlocal pos
        out: dict[str, list[Any]] = {}
        while pos < len(tokens) and tokens[pos] != end:
            name = tokens[pos]
            pos += 1
            if tokens[pos] == ":":
                pos += 1
            if tokens[pos] in ("{", "<"):
                close = "}" if tokens[pos] == "{" else ">"
                pos += 1
                value: Any = message(close)
                pos += 1
            else:
                value = scalar()
            out.setdefault(name, []).append(value)
            if pos < len(tokens) and tokens[pos] in (",", ";"):
                pos += 1
        return out

    def scalar() -> Any:
        nonlocal pos
        t = tokens[pos]
        if t[0] in "\"'":
            parts = []
            while pos < len(tokens) and tokens[pos][0] in "\"'":  # adjacent strings are one
                parts.append(codecs.escape_decode(tokens[pos][1:-1].encode("latin-1"))[0])
                pos += 1
            return b"".join(parts).decode("utf-8", "replace")
        pos += 1
        for kind in (int, float):
            try:
                return kind(t)
            except ValueError:
                pass
        return t

    return message(None)


def records_from_text(text: str) -> list[Op]:
    """:func:`records` of a GE graph stored in protobuf text format (a golden ``ge_graph.pbtxt``), read without
    torchair or protobuf: the same records, so a stored graph is checked by what checks a converted one."""
    graph = parse_pbtxt(text)

    def attrs_of(msg: dict[str, list[Any]]) -> dict[str, dict[str, list[Any]]]:
        return {a["key"][0]: a["value"][0] for a in msg.get("attr", [])}

    def desc(d: dict[str, list[Any]]) -> dict[str, Any]:
        attrs = attrs_of(d)
        meta = attrs["_meta"]["s"][0] if "_meta" in attrs else ""
        found = _SHAPE.search(meta)
        if found:
            shape = [int(x) for x in found.group(1).split(",") if x.strip()]
        else:
            shape = [int(x) for x in d.get("shape", [{}])[0].get("dim", [])]
        fx = attrs["_fx_tensor_name"]["s"][0] if "_fx_tensor_name" in attrs else ""
        return {"dtype": d.get("dtype", ["DT_UNDEFINED"])[0], "shape": shape, "fx": fx}

    out = []
    for op in graph.get("graph", [graph])[0].get("op", []):
        data, controls = [], []
        for src in op.get("input", []):
            if not src:
                continue
            name, _, index = src.rpartition(":")
            (controls if index == "-1" else data).append(name)
        attrs = attrs_of(op)
        found: dict[str, Any] = {}
        for key in ("group", "reduction"):
            if key in attrs:
                found[key] = attrs[key].get("s", [""])[0]
        for key in ("root_rank", "index"):
            if key in attrs:
                found[key] = attrs[key].get("i", [0])[0]
        for key in _TRANSPOSES:
            if key in attrs:
                found[key] = attrs[key].get("b", [False])[0] in (True, "true")
        stream = attrs["_user_stream_label"].get("s", [""])[0] if "_user_stream_label" in attrs else None
        out.append(
            {
                "name": op["name"][0],
                "type": op["type"][0],
                "inputs": data,
                "controls": controls,
                "stream": stream,
                "attrs": found,
                "in": [desc(d) for d in op.get("input_desc", [])],
                "out": [desc(d) for d in op.get("output_desc", [])],
            }
        )
    return out


def cache_writes(ops: Sequence[Op]) -> dict[str, Any]:
    """Each ``ScatterNdUpdate`` (a paged cache's write) by what it writes: ``in_place`` (the ``RefData`` inputs it
    updates, through views), ``copied`` (its write goes to a ``TensorMove`` of an input: the pool copied first), and
    ``problems``, one line per copied write (and none at all: no write found)."""
    by_name = {op["name"]: op for op in ops}

    def origin(name: str) -> Op:
        op = by_name[name]
        while op["type"] in _VIEWS and op["inputs"]:
            op = by_name[op["inputs"][0]]
        return op

    in_place, copied = [], []
    for op in ops:
        if op["type"] != "ScatterNdUpdate":
            continue
        var = origin(op["inputs"][0])
        if var["type"] == "RefData":
            in_place.append(var["name"])
        else:
            copied.append(f"{op['name']} writes {var['type']} {var['name']}")
    problems = [f"{c}: the pool is copied before the write (not in place on its RefData input)" for c in copied]
    if not in_place and not copied:
        problems.append("no ScatterNdUpdate: the paged cache is not written through its block table")
    return {"in_place": sorted(in_place), "copied": copied, "problems": problems}


def census(ops: Iterable[Op]) -> dict[str, int]:
    return dict(sorted(Counter(op["type"] for op in ops).items()))


def _bytes(desc: Mapping[str, Any]) -> int:
    return math.prod(desc["shape"]) * _ITEMSIZE.get(desc["dtype"], 0)


def group_ranks(group: str) -> list[int]:
    """The ranks of a GE ``group`` attribute as torchair writes it without HCCL: ``tag=...;rank_list=0,1``."""
    fields = dict(part.split("=", 1) for part in group.split(";") if "=" in part)
    return [int(r) for r in fields.get("rank_list", "").split(",") if r.strip()]


def hcom_schedule(ops: Sequence[Op], axis_of_ranks: Mapping[tuple[int, ...], str]) -> list[dict[str, Any]]:
    """The Hcom ops in graph (= program) order: op, mesh axis, group ranks, input bytes, root, reduction,
    stream."""
    out = []
    for op in ops:
        if not op["type"].startswith("Hcom"):
            continue
        ranks = group_ranks(op["attrs"].get("group", ""))
        entry = {
            "op": op["type"],
            "axis": axis_of_ranks.get(tuple(ranks), "?"),
            "ranks": ranks,
            "bytes": _bytes(op["in"][0]) if op["in"] else 0,
        }
        if "root_rank" in op["attrs"]:
            entry["root"] = op["attrs"]["root_rank"]
        if "reduction" in op["attrs"]:
            entry["reduce"] = op["attrs"]["reduction"]
        if op["stream"] is not None:
            entry["stream"] = op["stream"]
        out.append(entry)
    return out


_RING_WRITES = {
    "HcomBroadcast": 0,
    "ViewCopy": 0,
}  # GE ops that write their input (index) in place, as the ring uses them
_INPUTS = ("RefData", "Data")


def _topological(ops: Sequence[Op]) -> list[int]:
    """Graph positions in a topological order of the data and control edges (graph order where it is one).

    Raises:
        ValueError: an input names no op of the graph, or the edges form a cycle.
    """
    index = {op["name"]: i for i, op in enumerate(ops)}
    for op in ops:
        missing = [s for s in op["inputs"] + op["controls"] if s not in index]
        if missing:
            raise ValueError(f"GE op {op['name']} reads {missing}, which are not ops of the graph")
    done: list[int] = []
    state = [0] * len(ops)  # 0 unseen, 1 on the current path, 2 done
    for root in range(len(ops)):
        stack = [(root, False)]
        while stack:
            i, expanded = stack.pop()
            if expanded:
                state[i] = 2
                done.append(i)
                continue
            if state[i] == 2:
                continue
            if state[i] == 1:
                raise ValueError("the GE graph's edges form a cycle")
            state[i] = 1
            stack.append((i, True))
            for s in reversed(ops[i]["inputs"] + ops[i]["controls"]):
                if state[index[s]] == 1:
                    raise ValueError("the GE graph's edges form a cycle")
                if state[index[s]] == 0:
                    stack.append((index[s], False))
    return done


def ring_program(
    ops: Sequence[Op],
    *,
    k: int,
    series: int = 1,
    inputs: Sequence[str | None] | None = None,
    phase: int = 0,
) -> tuple[Any, dict[str, Any]]:
    """The prefetch ring's accesses in a GE graph, as a :class:`functional_npu.checks.hazard.Program` over the graph's
    partial order (data and control edges), and what the ring is made of.

    - a **slot** is a graph input (``RefData``; ``Data`` where torchair was not told it is written) whose value
      reaches an ``HcomBroadcast``'s buffer through in-place writes (``ViewCopy``'s ``dst``, ``HcomBroadcast``'s
      input; the op's output is the slot's next value), or that the input layout puts in the ring;
    - a slot is **bound** by its graph input index (its ``index``): its place among the ring's inputs (with the
      layout ``inputs``, its place in ``state.prefetched``) is its ring slot ``s`` (``series`` buffers per slot),
      which holds the layers ``v`` with ``(v + phase) mod (k + 1) = s``
      (:func:`functional_npu.checks.hazard.bind`);
    - **writes**: every ``HcomBroadcast`` on a slot, and the owner's ``ViewCopy`` of its parts into the slot, and
      a copy from host memory (a ring write with a group of one: ``ViewCopy`` of each part into a slot the layout
      names, the last one's value named after the FX ``ring_write``), with the virtual layer in issue order: write
      ``j`` (graph order) fetches layer ``k + j // series`` (``series``: the ring's buffers per slot, one per
      source and dtype; the slots' carried contents are layers ``0 .. k - 1``);
    - **waits**: a write completes on its stream; an op with a data edge from its output (torchair's
      ``Identity`` for ``wait_tensor``) starts only after it, GE synchronizing the two streams, so each direct
      consumer of a slot's value written by a broadcast or a host copy (other than the next write) is a wait on
      that slot;
    - **reads**: the first non-view ops a slot's value reaches (through ``Identity``, ``Reshape``, ``SplitV``, ...),
      other than writes into it and ``NetOutput`` (the next step's); each means the layer of the compute that
      uses it, read off the graph's per-layer inputs named by the layout
      (:func:`functional_npu.checks.hazard.read_layers`; no layout: none);
    - **allocs**: where an ``HcomBroadcast``'s buffer comes from an op of this graph (``Fill``, ``ConcatV2``, ...)
      and not from a graph input: that op, with the broadcast's bytes.

    Returns ``(program, ring)``, ``ring = {"slots": {slot: bytes}, "broadcasts": [{"broadcast", "layer", "slot",
    "root", "stream"}]}`` (a host copy's row: its last ``ViewCopy``, no root, and ``"source": "host"``).
    """
    from ..checks.hazard import Program, bind, input_layout, read_layers
    from ..checks.hazard_fx import ring_order

    topo = _topological(ops)  # first: it refuses an unknown input or a cycle
    index = {op["name"]: i for i, op in enumerate(ops)}
    consumers: dict[str, list[str]] = {op["name"]: [] for op in ops}
    for op in ops:
        for src in op["inputs"]:
            consumers[src].append(op["name"])
    ring_pos, layer_of = input_layout(inputs or [])
    graph_inputs = {op["attrs"]["index"]: op["name"] for op in ops if op["type"] in _INPUTS and "index" in op["attrs"]}
    slot_of: dict[str, str] = {}  # op whose output is a value of a slot -> the slot
    slots: dict[str, int] = {}
    for i in ring_pos:
        if i in graph_inputs:
            name = graph_inputs[i]
            slots[name], slot_of[name] = _bytes(ops[index[name]]["out"][0]) if ops[index[name]]["out"] else 0, name
    allocs, writes, rows = _ring_writes(ops, topo, index, k, series, slots, slot_of)
    issued = {row["broadcast"] for row in rows}
    waits, reads, value_of, views = _waits_and_reads(ops, index, consumers, slot_of, writes, issued)
    order = [ops[i]["name"] for i in topo]
    input_layer = {graph_inputs[i]: layer for i, layer in layer_of.items() if i in graph_inputs}
    ring = set(slot_of) | set(writes) | views | {op["name"] for op in ops if op["type"] == "NetOutput"}
    layers = read_layers(order, {op["name"]: op["inputs"] for op in ops}, input_layer, value_of, ring)
    reads = {r: (slot, layers.get(r)) for r, (slot, _) in reads.items()}
    position = {name: i for i, name in graph_inputs.items()}
    slot_index, initial = bind(
        ring_order({position.get(s, len(ops) + n): s for n, s in enumerate(slots)}, ring_pos), k, series, phase
    )
    after = {op["name"]: op["inputs"] + op["controls"] for op in ops}
    program = Program(order, after, writes, waits, reads, allocs, initial, slot_index, phase)
    return program, {"slots": slots, "broadcasts": rows}


def _ring_writes(
    ops: Sequence[Op],
    topo: Sequence[int],
    index: dict[str, int],
    k: int,
    series: int,
    slots: dict[str, int],
    slot_of: dict[str, str],
) -> tuple[dict[str, int], dict[str, tuple[str, int]], list[dict[str, Any]]]:
    """:func:`ring_program`'s allocs, writes (each broadcast and the in-place writes it takes its buffer from, with the
    virtual layer in issue order) and broadcast rows; fills in ``slots`` and ``slot_of``."""

    def origin(name: str) -> tuple[str, list[str]]:
        """Walk a buffer back through in-place writes and views to where its memory comes from."""
        chain = []
        while True:
            op = ops[index[name]]
            if op["type"] in _RING_WRITES:
                chain.append(name)
                name = op["inputs"][_RING_WRITES[op["type"]]]
            elif op["type"] == "Identity" and op["inputs"]:
                name = op["inputs"][0]
            else:
                return name, chain

    allocs: dict[str, int] = {}
    writes: dict[str, tuple[str, int]] = {}
    rows = []
    for j, op in enumerate(ops[i] for i in topo if _issued(ops[i], ops, index, slots, origin)):
        layer = k + j // max(1, series)
        source, chain = origin(op["inputs"][0])
        size = _bytes(op["out"][0]) if op["out"] else 0
        if ops[index[source]]["type"] not in _INPUTS:
            allocs[source] = max(allocs.get(source, 0), size)
            continue
        slots[source] = max(slots.get(source, 0), _bytes(ops[index[source]]["out"][0]), size)
        slot_of[source] = source
        for w in [op["name"], *chain]:
            slot_of[w] = source
            if ops[index[w]]["type"] in _RING_WRITES and w not in writes:
                writes[w] = (source, layer)
        row = {"broadcast": op["name"], "layer": layer, "slot": source, "root": op["attrs"].get("root_rank")}
        rows.append(row | {"stream": op["stream"]} | ({"source": "host"} if op["type"] != "HcomBroadcast" else {}))
    return allocs, writes, rows


def _issued(op: Op, ops: Sequence[Op], index: dict[str, int], slots: dict[str, int], origin: Any) -> bool:
    """Whether ``op`` ends one of the ring's writes: an ``HcomBroadcast``, or the last ``ViewCopy`` of a copy from
    host memory into a slot (a ring write with a group of one, whose value torchair names after the FX
    ``ring_write``; its parts' earlier copies are nameless), its slot known from the input layout."""
    if op["type"] == "HcomBroadcast":
        return True
    if op["type"] != "ViewCopy" or not op["out"] or _RING_WRITE not in op["out"][0]["fx"]:
        return False
    return origin(op["inputs"][0])[0] in slots


def _waits_and_reads(
    ops: Sequence[Op],
    index: dict[str, int],
    consumers: dict[str, list[str]],
    slot_of: dict[str, str],
    writes: dict[str, tuple[str, int]],
    issued: set[str],
) -> tuple[dict[str, str], dict[str, tuple[str, int | None]], dict[str, str], set[str]]:
    """:func:`ring_program`'s waits (a direct consumer of a write's value; ``issued``: each write's last op), reads
    (the first non-view ops a slot's value reaches), the slot value each read reads, and the views between them."""
    waits: dict[str, str] = {}
    reads: dict[str, tuple[str, int | None]] = {}
    value_of: dict[str, str] = {}
    views: set[str] = set()
    for value, slot in slot_of.items():
        for c in consumers[value]:
            if c in writes or ops[index[c]]["type"] == "NetOutput":
                continue
            if value in issued:  # a broadcast's value, or a host copy's last
                waits.setdefault(c, slot)
            todo, seen = [c], set()
            while todo:
                x = todo.pop()
                if x in seen:
                    continue
                seen.add(x)
                if ops[index[x]]["type"] in _VIEWS:
                    views.add(x)
                    todo.extend(consumers[x])
                elif x not in writes and ops[index[x]]["type"] != "NetOutput":
                    reads[x] = (slot, None)
                    value_of[x] = value
    return waits, reads, value_of, views


def ring_check(
    ops: Sequence[Op],
    *,
    k: int,
    num_layers: int,
    series: int = 1,
    axis_size: int,
    stream: str = "prefetch",
    inputs: Sequence[str | None] | None = None,
    phase: int = 0,
) -> dict[str, Any]:
    """Check a layer-sharded GE graph's prefetch ring with :func:`functional_npu.checks.hazard.check` over its
    partial order (:func:`ring_program`; ``inputs``: the graph's input layout, ``phase``: the schedule's), and each
    write's stream and each broadcast's root (``layer % axis_size``; a copy from host memory has none).

    Returns ``{"ok", "problems", "violations", "k", "ring_slots", "ring_bytes", "allocated_prefetch_bytes",
    "broadcasts": [...]}``; ``problems`` are the violations and the stream and root mismatches.
    """
    from ..checks.hazard import check

    program, ring = ring_program(ops, k=k, series=series, inputs=inputs, phase=phase)
    violations = check(program, k, series * (k + 1))
    problems = list(violations)
    expected = series * num_layers
    if len(ring["broadcasts"]) + len(program.allocs) != expected:
        problems.append(f"expected {expected} broadcasts, found {len(ring['broadcasts']) + len(program.allocs)}")
    for row in ring["broadcasts"]:
        if row["stream"] != stream:
            problems.append(
                f"{row['broadcast']} (layer {row['layer']}) runs on stream {row['stream']!r}, not {stream!r}"
            )
        if row.get("source") != "host" and row["root"] != (row["layer"] % num_layers) % axis_size:
            problems.append(f"{row['broadcast']} (layer {row['layer']}) broadcasts from {row['root']}")
    return {
        "ok": not problems,
        "problems": problems,
        "violations": violations,
        "k": k,
        "ring_slots": len(ring["slots"]),
        "ring_bytes": sum(ring["slots"].values()),
        "allocated_prefetch_bytes": sum(program.allocs.values()),
        "broadcasts_count": len(ring["broadcasts"]) + len(program.allocs),
        "broadcasts": ring["broadcasts"],
    }
