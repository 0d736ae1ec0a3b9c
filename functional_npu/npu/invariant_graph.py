"""What the invariant mode's NPU graphs hold: each op of a converted GE graph (torchair) or ACL graph (npugraph_ex's
FX graph) named by what it does to the bits, and whether any could reduce or round in an order of its own.

On the NPU backends the invariant ops reach the graph as the aten ops of their functions
(:func:`functional_npu.models.invariant_ops.decompositions`), so the graph holds the trees themselves. Its ops are:

- ``rounded``: IEEE arithmetic on two defined operands, one rounding each (Add, Sub, Mul, RealDiv; Cast, which
  rounds once where it narrows) -- the ops that carry the guarantee, on a device that rounds each on its own;
- ``exact``: ops whose result is exact in any order (max, clamp, floor, round, a remainder or a floor division of
  integral values, comparisons, selects, negation, bit casts);
- ``moves``: data movement, constants, graph inputs and outputs, collectives (a gather; the embedding's sum, one
  rank's row and zeros), a prefill's pick of each row's last position before the head (``GatherElements``);
- ``constants``: transcendental ops (the rope's frequencies: ``Pow``, ``Reciprocal``) allowed only where no graph
  input reaches them, so they compute the same values in every graph.

Any other op -- a MatMul, a ReduceSum or ReduceMean, a softmax, an Exp, a fused multiply-add -- is a problem: it
reduces or rounds in an order the device picks.

The batch-invariant mode (``Plan.invariant="batch"``, :mod:`functional_npu.models.batch_invariant`) keeps the matmul
units, so its graphs hold a fifth class, ``pinned``: MatMul and BatchMatMul, each at a shape the batch cannot
change but in its rows (:func:`ge_batch_check` records each one's rows, reduced dim and columns, and fails one whose
rows are not a multiple of the mode's row tile). Every other reduction of that mode is one of them (row sums are a
matmul with a column of ones), so the rest of its graph is the classes above. That the device's MatMul gives a row
the same bits at every row count that is a multiple of the tile is the kernel's property, measured on the CPU
(:func:`~functional_npu.models.batch_invariant.probe`) and only on a device for the NPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "GE_OPS",
    "ACL_OPS",
    "GE_MATMULS",
    "ACL_MATMULS",
    "WHY",
    "ge_check",
    "acl_check",
    "ge_batch_check",
    "acl_batch_check",
]

GE_OPS: Mapping[str, frozenset[str]] = {
    "rounded": frozenset("Add Sub Mul RealDiv Cast".split()),
    "exact": frozenset(
        "ArgMaxWithValue ReduceMax ClipByValueV2 Floor Round FloorMod FloorDiv Neg Equal Less LessEqual GreaterEqual "
        "LogicalAnd LogicalNot SelectV2 MaskedFill Bitcast".split()
    ),
    "moves": frozenset(
        "Const Data RefData NetOutput Reshape Squeeze Unsqueeze StridedSliceV2 SplitV ConcatV2 Pack GatherV2 "
        "GatherElements ScatterElements TensorMove BroadcastTo Fill ZerosLike Shape Range Identity Transpose PadV3 "
        "HcomAllGather HcomAllReduce".split()
    ),
    "constants": frozenset("Pow Reciprocal".split()),
}
ACL_OPS: Mapping[str, frozenset[str]] = {  # aten ops, an in-place one as its functional form
    "rounded": frozenset("add.Tensor sub.Tensor mul.Tensor div.Tensor _to_copy.default".split()),
    "exact": frozenset(
        "max.dim clamp.default floor.default round.default remainder.Scalar floor_divide.default neg.default eq.Scalar "
        "ge.Scalar le.Tensor lt.Scalar bitwise_and.Tensor bitwise_not.default where.self masked_fill.Scalar "
        "view.dtype".split()
    ),
    "moves": frozenset(
        "reshape.default view.default _unsafe_view.default clone.default slice.Tensor select.int squeeze.dim "
        "unsqueeze.default split.Tensor split_with_sizes.default cat.default permute.default expand.default "
        "embedding.default gather.default scatter.src arange.default arange.start_step full_like.default "
        "zeros_like.default scalar_tensor.default getitem all_gather_into_tensor.default all_reduce.default "
        "wait_tensor.default ones.default detach.default t.default transpose.int constant_pad_nd.default".split()
    ),
    "constants": frozenset("pow.Scalar reciprocal.default".split()),
}
_INPUTS = {"Data", "RefData"}
GE_MATMULS = frozenset("MatMul MatMulV2 MatMulV3 BatchMatMul BatchMatMulV2 BatchMatMulV3".split())
ACL_MATMULS = frozenset("mm.default bmm.default".split())
WHY: Mapping[str, str] = {  # per class, why its ops' order cannot depend on the batch
    "rounded": "elementwise: one rounding per element, no order to pick",
    "exact": "exact in any order",
    "moves": "moves or copies bits",
    "constants": "no graph input reaches it: the same values in every graph",
    "pinned": "a matmul at a pinned shape: the reduced dim whole and fixed, only the rows vary, in multiples of the "
    "row tile",
}


def _check(
    ops: Iterable[tuple[str, str]], classes: Mapping[str, frozenset[str]], fed: Callable[[str], bool]
) -> dict[str, Any]:
    """``ops``: (name, kind) pairs; ``fed(name)``: whether a graph input reaches that op."""
    found: dict[str, Counter[str]] = {c: Counter() for c in (*classes, "other")}
    first: dict[str, str] = {}  # each problem kind's first op
    for name, kind in ops:
        cls = next((c for c, kinds in classes.items() if kind in kinds), "other")
        found[cls][kind] += 1
        if cls == "other" or (cls == "constants" and fed(name)):
            first.setdefault(kind, name)
    problems = [
        f"{kind} x{found['other'][kind]} (first {name}): not an op of the invariant functions; it may reduce or "
        f"round in an order of its own"
        if found["other"][kind]
        else f"{kind} ({name}): a transcendental op on values a graph input reaches"
        for kind, name in first.items()
    ]
    ops_by_class = {c: dict(sorted(n.items())) for c, n in found.items() if n}
    return {"ok": not problems, "ops": ops_by_class, "problems": problems}


def _reached(sources: Mapping[str, Sequence[str]], roots: set[str]) -> Callable[[str], bool]:
    """``name -> whether any of roots is among its ancestors`` over the data edges ``sources``."""

    def reached(name: str) -> bool:
        seen, todo = set(), list(sources.get(name, ()))
        while todo:
            src = todo.pop()
            if src in roots:
                return True
            if src not in seen:
                seen.add(src)
                todo += sources.get(src, ())
        return False

    return reached


def _ge_classes(ops: Sequence[dict[str, Any]], classes: Mapping[str, frozenset[str]]) -> dict[str, Any]:
    """:func:`_check` of GE op records by ``classes``, a graph input's reach followed over their data edges."""
    sources = {op["name"]: op["inputs"] for op in ops}
    fed = _reached(sources, {op["name"] for op in ops if op["type"] in _INPUTS})
    return _check(((op["name"], op["type"]) for op in ops), classes, fed)


def ge_check(ops: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The GE op records (:func:`functional_npu.npu.ge_graph.records`) of an invariant graph by class
    (:data:`GE_OPS`): ``{"ok", "ops": {class: {type: count}}, "float64": {type: count}, "problems"}``;
    ``float64``: the ops computing in double (rotary's ``sin_cos``), which a device runs on its AI CPU."""
    out = _ge_classes(ops, GE_OPS)
    double = Counter(
        op["type"]
        for op in ops
        if op["type"] != "Const" and any(d["dtype"] == "DT_DOUBLE" for d in op["in"] + op["out"])
    )
    return out | {"float64": dict(sorted(double.items()))}


def _aten(node: torch.fx.Node) -> str:
    """``aten.add_.Tensor`` -> ``add.Tensor`` (an in-place op rounds as its functional one); ``getitem``."""
    if not isinstance(node.target, (torch._ops.OpOverload, str)):
        return getattr(node.target, "__name__", str(node.target))
    op, overload = str(node.target).split(".")[-2:]
    return f"{op if op.startswith('_') else op.rstrip('_')}.{overload}"


def acl_check(graph: torch.fx.Graph) -> dict[str, Any]:
    """An invariant ACL graph's aten ops (in-place ones as their functional forms) by class (:data:`ACL_OPS`):
    ``{"ok", "ops": {class: {op: count}}, "problems"}``."""
    return _acl_classes(graph, ACL_OPS)


def _acl_classes(graph: torch.fx.Graph, classes: Mapping[str, frozenset[str]]) -> dict[str, Any]:
    """:func:`_check` of an FX graph's calls by ``classes``, a placeholder's reach followed over their inputs."""
    calls = [n for n in graph.nodes if n.op == "call_function"]
    sources = {n.name: [a.name for a in n.all_input_nodes] for n in calls}
    fed = _reached(sources, {n.name for n in graph.nodes if n.op == "placeholder"})
    return _check(((n.name, _aten(n)) for n in calls), classes, fed)


def _pinned(classes: Mapping[str, frozenset[str]], matmuls: frozenset[str]) -> dict[str, frozenset[str]]:
    return {**classes, "pinned": matmuls}


def ge_batch_check(ops: Sequence[dict[str, Any]], rows: int) -> dict[str, Any]:
    """The GE op records of a batch-invariant graph: :func:`ge_check`'s classes plus ``pinned``
    (:data:`GE_MATMULS`), ``"why"`` per class (:data:`WHY`) and ``"matmuls"``: per MatMul / BatchMatMul its
    ``{"name", "type", "rows", "reduced", "columns"}`` (from its inputs' shapes and transpose flags). A matmul
    whose rows are not a multiple of ``rows`` (the mode's row tile,
    :data:`~functional_npu.models.batch_invariant.ROWS`) is a problem: its kernel may take another order at another
    row count."""
    out = _ge_classes(ops, _pinned(GE_OPS, GE_MATMULS))
    found, problems = [], list(out["problems"])
    for op in ops:
        if op["type"] not in GE_MATMULS:
            continue
        flip = op["attrs"].get("transpose_x1", op["attrs"].get("adj_x1", False))
        m, k = op["in"][0]["shape"][-2:][:: -1 if flip else 1]  # x1: [M, K], or [K, M] transposed
        flip = op["attrs"].get("transpose_x2", op["attrs"].get("adj_x2", False))
        n = op["in"][1]["shape"][-2 if flip else -1]  # x2: [K, N], or [N, K] transposed
        found.append({"name": op["name"], "type": op["type"], "rows": m, "reduced": k, "columns": n})
        if m % rows:
            problems.append(
                f"{op['type']} ({op['name']}): {m} rows, not a multiple of the row tile {rows}: its kernel may reduce "
                f"in another order at another row count"
            )
    return out | {"ok": not problems, "problems": problems, "matmuls": found, "why": dict(WHY)}


def acl_batch_check(graph: torch.fx.Graph) -> dict[str, Any]:
    """A batch-invariant ACL graph's aten ops by class: :func:`acl_check`'s plus ``pinned`` (:data:`ACL_MATMULS`),
    and ``"why"`` per class. The graph text holds no shapes: the matmuls' shapes are those of the same trace's GE
    graph (:func:`ge_batch_check`)."""
    return _acl_classes(graph, _pinned(ACL_OPS, ACL_MATMULS)) | {"why": dict(WHY)}
