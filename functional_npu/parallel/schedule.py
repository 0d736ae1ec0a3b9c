"""An inductor scheduling pass that keeps layer-weight prefetch ``k`` layers ahead, with bounded buffers.

The forward (see :mod:`functional_npu.prefetch`) issues the broadcast of layer ``l + k``'s weight
before layer ``l`` and uses the weight of layer ``l`` after waiting on it; the first ``k`` layers'
weights arrive as carried inputs (prefetched by the previous step) and are waited on the same way.
Inductor does not keep that program order: its default scheduling puts each broadcast next to its
wait (no overlap), and its ``raise_comms`` pass hoists every broadcast to the top (overlap, but
every layer's buffer live at once). This pass rebuilds the order from the dependency graph:

* a *use* is a prefetch wait (a wait on a broadcast, or on a carried graph input), ordered by the
  position of its first consumer; uses ``U[0], U[1], ...`` are the layer weights in order of need;
* an *issue* is a broadcast together with the kernels that only feed it (the copy of the owned
  layer into the send buffer), ordered the same way; broadcasts whose result is only returned (the
  next step's first ``k`` layers, handed over in flight, with no wait in this graph) come last, in
  output order;
* issue ``i`` is placed right before use ``i``, and each wait right before its first consumer.

With ``k`` carried weights, issue ``i`` serves use ``i + k``: each broadcast is in flight while
``k`` layers compute, and at most ``k + 1`` prefetch buffers are live. Everything else (compute,
tensor-parallel collectives and their waits) keeps its relative order. The result is checked to be
a valid topological order; a graph without the expected structure raises :class:`ScheduleError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PrefetchSchedule", "ScheduleError", "BUILT_FOR", "IR_NEEDS"]

BUILT_FOR = "2.13"  # the torch line whose scheduler IR this pass reads
# what the pass reads from inductor: scheduler-node methods and attributes, and the module functions
IR_NEEDS = {
    "torch._inductor.scheduler.BaseSchedulerNode": (
        "get_buffer_names",
        "get_outputs",
        "get_name",
        "unmet_dependencies",
        "read_writes",
        "node",
    ),
    "torch._inductor.utils": ("is_collective", "is_wait"),
    "torch._inductor.graph.GraphLowering": ("graph_inputs", "get_output_names"),
    "torch._inductor.config": ("reorder_for_compute_comm_overlap", "reorder_for_compute_comm_overlap_passes"),
}


class ScheduleError(RuntimeError):
    """The compiled graph does not have the prefetch structure the pass expects."""


def _names(snode: Any) -> set[str]:
    return set(snode.get_buffer_names()) | {o.get_name() for o in snode.get_outputs()}


def _reads(snode: Any) -> set[str]:
    return {d.name for d in snode.unmet_dependencies} | {d.name for d in snode.read_writes.reads}


def _real_reads(snode: Any, drop: set[str]) -> set[str]:
    """What ``snode`` must run after, without its ordering-only ("fake") deps on the names in ``drop``."""
    deps = set(snode.unmet_dependencies) | set(snode.read_writes.reads)
    return {d.name for d in deps if not (getattr(d, "is_fake", False) and d.name in drop)}


def _is_broadcast(snode: Any) -> bool:
    from torch._inductor.utils import is_collective

    ops = torch.ops._c10d_functional
    return is_collective(snode.node, ops.broadcast_.default) or is_collective(snode.node, ops.broadcast.default)


def _is_collective(snode: Any) -> bool:
    from torch._inductor.utils import is_collective

    return is_collective(snode.node)


def _is_wait(snode: Any) -> bool:
    from torch._inductor.utils import is_wait

    return is_wait(snode.node)


@dataclass(frozen=True)
class PrefetchSchedule:
    """The pass, for ``torch._inductor.config.reorder_for_compute_comm_overlap_passes``.

    Attributes:
        carried: how many prefetched weights arrive as carried inputs (``k`` times the number of
            layer-sharded series); checked against the graph.
        issues: how many broadcasts the graph holds (layers times series); checked likewise.
    """

    carried: int
    issues: int

    def __call__(self, snodes: Sequence[Any]) -> list[Any]:
        from torch._inductor.virtualized import V

        try:
            inputs = set(V.graph.graph_inputs)
            outputs = list(V.graph.get_output_names())
            return reorder(list(snodes), inputs, outputs, self.carried, self.issues)
        except (AttributeError, TypeError) as e:  # the scheduler IR is a prototype: say which torch moved it
            raise ScheduleError(
                f"the prefetch pass reads inductor's scheduler IR as torch {BUILT_FOR} has it; torch "
                f"{torch.__version__} changed it ({type(e).__name__}: {e}). Pin torch {BUILT_FOR}.* or update "
                f"functional_npu.parallel.schedule"
            ) from e


def reorder(snodes: list[Any], inputs: set[str], outputs: list[str], carried: int, n_issues: int) -> list[Any]:
    """The prefetch order of ``snodes`` (see the module docstring)."""
    broadcasts, carried_waits = _prefetch_nodes(snodes, inputs, carried, n_issues)
    graph = _graph(snodes, broadcasts, carried_waits)
    wait_of = _wait_of(graph, broadcasts)
    group = {id(b): _issue_group(graph, b) for b in broadcasts}

    # issues in order of need; the last ``carried`` are the next step's, handed over (returned, or
    # only copied into an output at the end)
    def need(b: Any) -> tuple[int, int]:
        w = wait_of[id(b)]
        return (len(snodes), _output_rank(b, outputs)) if w is None else (graph.first_use(w), _output_rank(w, outputs))

    issues = sorted(broadcasts, key=need)
    unwaited = [b.get_name() for b in issues[: len(issues) - carried] if wait_of[id(b)] is None]
    if unwaited:
        raise ScheduleError(f"broadcasts {unwaited} are never waited on, yet only {carried} are handed over")
    order = _place(graph, issues, carried_waits, wait_of, group, carried)
    _check_topological(order, snodes, graph.producer, graph.needs)
    return order


@dataclass(frozen=True)
class _Graph:
    """The nodes and their real dependencies: what each needs (by buffer name), who produces and who consumes it."""

    snodes: list[Any]
    producer: dict[str, Any]
    needs: dict[int, set[str]]
    consumers: dict[int, list[Any]]
    position: dict[int, int]

    def first_use(self, w: Any) -> int:
        """The position of ``w``'s first consumer (past the end when it has none)."""
        return min((self.position[id(c)] for c in self.consumers[id(w)]), default=len(self.snodes))


def _prefetch_nodes(snodes: list[Any], inputs: set[str], carried: int, n_issues: int) -> tuple[list[Any], list[Any]]:
    """The prefetch broadcasts and the waits on carried inputs, checked against the counts the pass expects."""
    broadcasts = [s for s in snodes if _is_broadcast(s)]
    carried_waits = [s for s in snodes if _is_wait(s) and _reads(s) and _reads(s) <= inputs]
    if len(broadcasts) != n_issues or len(carried_waits) != carried:
        raise ScheduleError(
            f"the graph has {len(broadcasts)} prefetch broadcasts and {len(carried_waits)} waits on carried inputs; "
            f"expected {n_issues} and {carried}"
        )
    return broadcasts, carried_waits


def _graph(snodes: list[Any], broadcasts: list[Any], carried_waits: list[Any]) -> _Graph:
    """The dependency graph of ``snodes``, without the ordering-only deps between prefetch and other collectives."""
    producer = {name: s for s in snodes for name in _names(s)}
    waits_of_broadcasts = [s for s in snodes if _is_wait(s) and any(producer.get(n) in broadcasts for n in _reads(s))]
    # Inductor chains every in-place collective after the previous one and its wait with ordering-only
    # ("fake") deps, whatever their groups and buffers. Between the prefetch broadcasts (fresh send
    # buffers) and the other collectives that order would serialize the prefetch; it is dropped there,
    # and kept among the other collectives. Every rank builds the same order, so the issue order of
    # each process group still agrees across ranks. All data dependencies are kept.
    prefetch = broadcasts + waits_of_broadcasts + carried_waits
    prefetch_names = {n for s in prefetch for n in _names(s)}
    comm_names = {n for s in snodes if _is_wait(s) or _is_collective(s) for n in _names(s)}
    is_prefetch = {id(s) for s in prefetch}
    needs = {
        id(s): _real_reads(
            s, comm_names if id(s) in is_prefetch else prefetch_names if _is_wait(s) or _is_collective(s) else set()
        )
        for s in snodes
    }
    consumers: dict[int, list[Any]] = {id(s): [] for s in snodes}
    for s in snodes:
        for name in needs[id(s)]:
            p = producer.get(name)
            if p is not None and p is not s:
                consumers[id(p)].append(s)
    return _Graph(snodes, producer, needs, consumers, {id(s): i for i, s in enumerate(snodes)})


def _wait_of(graph: _Graph, broadcasts: list[Any]) -> dict[int, Any]:
    """Each broadcast's wait (by the broadcast's id), None for one handed over in flight; a ScheduleError
    for more than one."""
    wait_of = {}
    for b in broadcasts:
        waits = [c for c in graph.consumers[id(b)] if _is_wait(c)]
        if len(waits) > 1:
            raise ScheduleError(f"broadcast {b.get_name()} has {len(waits)} waits; expected at most one")
        wait_of[id(b)] = waits[0] if waits else None
    return wait_of


def _issue_group(graph: _Graph, b: Any) -> list[Any]:
    """The kernels that only feed broadcast ``b`` (its send buffer: a copy of the owned layer, or the
    concatenation a coalesced buffer is built by, step by step), in order, then ``b``: they travel together."""
    producer = graph.producer
    group = {id(b): b}
    grew = True
    while grew:  # add every producer whose consumers all lie in the group already
        grew = False
        for member in list(group.values()):
            for name in graph.needs[id(member)]:
                f = producer.get(name)
                if f is None or id(f) in group or _is_wait(f) or _is_collective(f):
                    continue
                if all(id(c) in group for c in graph.consumers[id(f)]):
                    group[id(f)] = f
                    grew = True
    return sorted((s for s in group.values() if s is not b), key=lambda s: graph.position[id(s)]) + [b]


def _output_rank(w: Any, outputs: list[str]) -> int:
    """The first graph output ``w`` produces (past the end when none)."""
    return min([outputs.index(n) for n in _names(w) if n in outputs], default=len(outputs))


def _place(
    graph: _Graph,
    issues: list[Any],
    carried_waits: list[Any],
    wait_of: dict[int, Any],
    group: dict[int, list[Any]],
    carried: int,
) -> list[Any]:
    """The order: issue ``i`` (its group) and use ``i`` right before that use's first consumer, the rest kept in place,
    the hand-over issues (the last ``carried``) at the end."""
    snodes = graph.snodes
    used_here = [wait_of[id(b)] for b in issues[: len(issues) - carried]]
    uses = sorted(carried_waits + used_here, key=graph.first_use)
    before: dict[int, list[Any]] = {}  # a node -> what goes right before it
    for i, w in enumerate(uses):
        before.setdefault(id(snodes[graph.first_use(w)]), []).extend(group[id(issues[i])] + [w])
    for b in issues[len(issues) - carried :]:  # a hand-over wait read by an output copy goes right before it
        w = wait_of[id(b)]
        if w is not None and graph.consumers[id(w)]:
            before.setdefault(id(snodes[graph.first_use(w)]), []).append(w)
    with_wait = {id(b): group[id(b)] + [w for w in [wait_of[id(b)]] if w is not None] for b in issues}
    moved = {id(s) for b in issues for s in with_wait[id(b)]} | {id(w) for w in carried_waits}
    order: list[Any] = []
    for s in snodes:
        if id(s) not in moved:
            order += before.get(id(s), []) + [s]
    placed = {id(s) for s in order}
    order += [s for b in issues for s in with_wait[id(b)] if id(s) not in placed]  # the hand-over
    return order


def _check_topological(
    order: list[Any], snodes: list[Any], producer: dict[str, Any], needs: dict[int, set[str]]
) -> None:
    done: set[int] = set()
    for s in order:
        for name in needs[id(s)]:
            p = producer.get(name)
            if p is not None and p is not s and id(p) not in done:
                raise ScheduleError(
                    f"prefetch schedule would run {s.get_name()} before {p.get_name()}, which produces {name}"
                )
        done.add(id(s))
    if len(order) != len(snodes) or done != {id(s) for s in snodes}:
        raise ScheduleError("prefetch schedule lost or duplicated a node")
