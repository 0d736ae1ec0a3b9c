"""What a converted GE graph says, read from the graph itself.

:func:`records` turns a GE ``GraphDef`` (torchair's protobuf message) into plain op records; all
else here works on those records, so it needs neither torchair nor protobuf:

- :func:`census`: GE op type -> count;
- :func:`hcom_schedule`: the ordered Hcom ops (``HcomAllReduce``, ``HcomBroadcast``, ...) with their
  group's ranks and mesh axis, bytes, root and stream;
- :func:`prefetch_order`: whether the graph's **partial order** (data and control edges; GE may run
  any order they allow) keeps the layer-shard prefetch bounds: every broadcast on the prefetch stream,
  the issue of layer ``j`` waiting for the uses of layer ``j - k - 1`` and for nothing later, and at
  most ``k + 1`` buffers per series live in *any* order.

A prefetch buffer is the output of an ``HcomBroadcast``, or a graph input carried from the previous
step that reaches a ``_c10d_functional.wait_tensor`` (a collective still in flight when the previous
step handed it over; the next step's broadcasts leave this graph unwaited the same way). Its uses
are the first non-view ops its value reaches (a matmul), or the graph output (the next step's).
Buffer ``i`` is dead before buffer ``j`` starts only if every use of ``i`` is an ancestor of
``j``'s start; a set of buffers can be live together in some order exactly when that holds for no
pair taken from the set's down-set of starts (see :func:`max_live`).
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["records", "census", "hcom_schedule", "HCOM_OF", "ancestors", "max_live", "prefetch_order"]

Op = dict[str, Any]

HCOM_OF = {  # aten functional collective -> the GE op torchair converts it to
    "all_reduce": "HcomAllReduce",
    "all_gather_into_tensor": "HcomAllGather",
    "reduce_scatter_tensor": "HcomReduceScatter",
    "all_to_all_single": "HcomAllToAllV",
    "broadcast": "HcomBroadcast",
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


def records(graph: Any, dtype_name: Any = str) -> list[Op]:
    """Plain records of a GE ``GraphDef``'s ops, in graph order.

    Each is ``{"name", "type", "inputs": [op names], "controls": [op names], "stream", "attrs": {group,
    root_rank, reduction (when present)}, "in": [desc], "out": [desc]}`` with ``desc = {"dtype",
    "shape", "fx"}``. ``dtype_name`` maps GE's dtype enum to its name (``DataType.Name``).
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
        if "root_rank" in op.attr:
            attrs["root_rank"] = op.attr["root_rank"].i
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


# ---- the partial order --------------------------------------------------------------------------
def ancestors(ops: Sequence[Op]) -> dict[str, int]:
    """For every op, the bitset (over graph positions) of the ops that must run before it, itself
    excluded: the transitive closure of data and control edges.

    Raises:
        ValueError: an input names no op of the graph, or the edges form a cycle.
    """
    index = {op["name"]: i for i, op in enumerate(ops)}
    preds: list[list[int]] = []
    for op in ops:
        srcs = op["inputs"] + op["controls"]
        missing = [s for s in srcs if s not in index]
        if missing:
            raise ValueError(f"GE op {op['name']} reads {missing}, which are not ops of the graph")
        preds.append([index[s] for s in srcs])
    succs: list[list[int]] = [[] for _ in ops]
    indegree = [len(p) for p in preds]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    ready = [i for i, d in enumerate(indegree) if d == 0]
    anc = [0] * len(ops)
    done = 0
    while ready:
        i = ready.pop()
        done += 1
        for p in preds[i]:
            anc[i] |= anc[p] | (1 << p)
        for s in succs[i]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    if done != len(ops):
        raise ValueError("the GE graph's edges form a cycle")
    return {op["name"]: anc[i] for i, op in enumerate(ops)}


def max_live(starts: Sequence[int], uses: Sequence[int], below: Mapping[int, int]) -> tuple[int, list[int]]:
    """The most buffers live at once over every order the partial order allows, and one such set.

    Buffer ``b`` starts at op ``starts[b]`` and is dead once every op in bitset ``uses[b]`` ran;
    ``below[i]`` is op ``i``'s ancestors (bitset). A set ``S`` is live together in some order iff
    after running exactly the down-set ``D`` of its starts (starts included), every buffer of ``S``
    still has a use outside ``D``; feasibility is closed under subsets, so sizes are tried upwards.
    """
    best: list[int] = []
    buffers = range(len(starts))
    for size in range(1, len(starts) + 1):
        found = None
        for subset in itertools.combinations(buffers, size):
            down = 0
            for b in subset:
                down |= below[starts[b]] | (1 << starts[b])
            if all(uses[b] & ~down for b in subset):
                found = list(subset)
                break
        if found is None:
            break
        best = found
    return len(best), best


def _buffers(ops: Sequence[Op]) -> list[dict[str, Any]]:
    """Prefetch buffers in graph order: ``{"start": position, "source": name, "broadcast": bool,
    "uses": [positions]}`` (see the module docstring)."""
    index = {op["name"]: i for i, op in enumerate(ops)}
    consumers: list[list[int]] = [[] for _ in ops]
    for i, op in enumerate(ops):
        for src in op["inputs"]:
            consumers[index[src]].append(i)

    def uses(i: int) -> list[int]:
        found, todo, seen = [], list(consumers[i]), set()
        while todo:
            c = todo.pop()
            if c in seen:
                continue
            seen.add(c)
            if ops[c]["type"] in _VIEWS:
                todo.extend(consumers[c])
            else:
                found.append(c)
        return sorted(found)

    out = []
    for i, op in enumerate(ops):
        waited = any(_WAIT in d["fx"] for c in consumers[i] for d in ops[c]["out"] if ops[c]["type"] == "Identity")
        if op["type"] == "HcomBroadcast" or (waited and op["type"] == "Data"):
            out.append({"start": i, "source": op["name"], "broadcast": op["type"] == "HcomBroadcast", "uses": uses(i)})
    return out


def prefetch_order(
    ops: Sequence[Op], *, k: int, num_layers: int, series: Sequence[str], axis_size: int, stream: str = "prefetch"
) -> dict[str, Any]:
    """Check a layer-sharded graph's prefetch over its partial order; returns the findings and ``ok``.

    The carried inputs are layers ``0 .. k-1``; the broadcasts, in program order, layers ``k ..
    L + k - 1`` (the last ``k`` are the next step's, handed out), each ``len(series)`` in a row
    (``series`` names what one layer's broadcasts carry: one entry per coalesced buffer).
    Checked: the number of buffers; each broadcast's stream and root (``layer % axis_size``); the
    latest layer whose uses every broadcast must wait for (expected ``layer - k - 1``, ``None`` for
    none); and the most buffers live at once, per series and in all (expected ``k + 1`` and
    ``len(series) * (k + 1)``).
    """
    n = len(series)
    below = {i: a for i, a in enumerate(ancestors(ops).values())}
    found = _buffers(ops)
    carried = [b for b in found if not b["broadcast"]]
    issued = [b for b in found if b["broadcast"]]
    problems = []
    if len(carried) != n * k or len(issued) != n * num_layers:
        problems.append(
            f"expected {n * k} carried buffers and {n * num_layers} broadcasts, found {len(carried)} and {len(issued)}"
        )
        return {"ok": False, "problems": problems}
    # carried buffers in order of their first use: layers 0 .. k-1, series order within a layer
    carried.sort(key=lambda b: min(b["uses"]) if b["uses"] else len(ops))
    buffers = carried + issued
    layer_of = [j // n for j in range(len(buffers))]
    uses_of_layer: dict[int, int] = {}
    for b, layer in zip(buffers, layer_of):
        for u in b["uses"]:
            uses_of_layer[layer] = uses_of_layer.get(layer, 0) | (1 << u)
    rows = []
    for j in range(n * k, len(buffers)):
        b, layer = buffers[j], layer_of[j]
        op = ops[b["start"]]
        must = below[b["start"]]
        waits = [m for m in range(num_layers) if uses_of_layer.get(m, 0) & must]
        after = max(waits) if waits else None
        expected = layer - k - 1 if layer - k - 1 >= 0 else None
        complete = after is None or uses_of_layer[after] & must == uses_of_layer[after]
        rows.append(
            {
                "broadcast": op["name"],
                "layer": layer,
                "leaf": series[j % n],
                "root": op["attrs"].get("root_rank"),
                "stream": op["stream"],
                "waits_for_layer": after,
            }
        )
        if op["stream"] != stream:
            problems.append(f"{op['name']} (layer {layer}) runs on stream {op['stream']!r}, not {stream!r}")
        if op["attrs"].get("root_rank") != (layer % num_layers) % axis_size:
            problems.append(f"{op['name']} (layer {layer}) broadcasts from {op['attrs'].get('root_rank')}")
        if after != expected or not complete:
            problems.append(
                f"{op['name']} (layer {layer}) must wait for the uses of layer {after}, expected {expected}"
                + ("" if complete else " (only some of them)")
            )
    starts = [b["start"] for b in buffers]
    all_uses = [sum(1 << u for u in b["uses"]) for b in buffers]
    per_series = []
    for s in range(n):
        picked = [j for j in range(len(buffers)) if j % n == s]
        live, _ = max_live([starts[j] for j in picked], [all_uses[j] for j in picked], below)
        per_series.append(live)
    total, witness = max_live(starts, all_uses, below)
    if max(per_series) > k + 1 or total > n * (k + 1):
        problems.append(
            f"up to {max(per_series)} buffers of one series ({total} in all) can be live at once, "
            f"bound {k + 1} ({n * (k + 1)})"
        )
    return {
        "ok": not problems,
        "problems": problems,
        "k": k,
        "max_live_per_series": per_series,
        "max_live": total,
        "max_live_witness": [ops[starts[j]]["name"] for j in witness],
        "bound_per_series": k + 1,
        "broadcasts": rows,
    }
