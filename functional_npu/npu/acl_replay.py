"""Replaying a compiled forward through npugraph_ex's capture path on a host with no NPU: the addresses each captured
graph is replayed with, and how often npugraph_ex would capture it again.

An ACL graph keeps the addresses it was captured with. Before each replay npugraph_ex copies the inputs the graph
only reads into the buffers of the capture (``clone_input``). The inputs the graph writes in place (its
``mutated_user_inputs``: here the prefetch ring's slots and the KV caches) it uses where they lie: before each replay
``AclGraph.is_need_to_recapture`` compares their ``data_ptr`` with those recorded at capture, and a moved one makes
npugraph_ex capture the graph again (counted in dynamo's ``counters["npugraph_ex"]`` as
``recapture_due_to_mutated_input_change_<graph>``). A forward whose slot inputs change between steps is therefore
captured anew at every step where one moved.

:func:`replay` compiles a function with npugraph_ex's backend and calls it ``steps`` times with the same arguments,
as serving calls the forward with the same decode state, in a process set up by :func:`install`.

**What runs is npugraph_ex's**: its backend and passes; the module it generates for each graph (``codegen``: the
``kernel`` around the graph's ``forward``, written from the FX graph after its passes with one ``torch.npu.stream``
block per stream scope); the ``AclGraphCacheInfo`` that module builds and loads (``user_inputs_mapping``: placeholder
name -> argument index for every tensor input not marked static; ``mutated_user_inputs``: the placeholder names that
``_find_mutated_user_inputs`` finds written in place, ``npu_fx_compiler.py:673``); its graph key
(``get_unupdated_input_fn``); and its ``AclGraph.is_need_to_recapture`` and ``AclGraph._save_stream_core_limits``,
called unbound on the stand-in below.

**What is stood in** is the capture and replay of an NPU graph. The stand-in ``AclGraph`` (:class:`ReplayedGraph`)
does per call what ``AclGraph.compile`` (``acl_graph.py:1026``) does before it captures: the graph key, the recapture
check, the capture limit (``capture_limit``: a new capture when as many graphs as the limit are held falls back to
eager for good). It records a capture's addresses as ``compile_for_graph_key`` does (``acl_graph.py:1224``). Then it
runs the generated ``forward`` eagerly on the CPU, every op in program order: the stream blocks and the event records
and waits do nothing (one CPU stream), and the collectives run on torch's fake process group. One op has a kernel
for the NPU only, ``npu_define.all_to_all_single_npu`` (npugraph_ex's ``ops/_hcom_alltoall.py``, which its passes
put in place of ``all_to_all_single``): on the CPU it runs as its meta kernel describes it
(:func:`_all_to_all_rows`; see :func:`_all_to_all_on_cpu` for how the NPU kernel differs). The stand-in streams
report fixed core limits (:data:`functional_npu.npu.acl_graph.CORE_LIMITS`), so no recapture here is ever for a
change of core limits.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from . import acl_graph

__all__ = ["install", "ReplayedGraph", "replay", "recapture_problems"]

_REAL: list[Any] = []  # npugraph_ex's own AclGraph class, kept when the stand-in takes its place
_GRAPHS: list[ReplayedGraph] = []


def install(dynamo_dir: Path) -> None:
    """:func:`functional_npu.npu.acl_graph.install`, and :class:`ReplayedGraph` in place of the ``AclGraph`` that
    npugraph_ex's generated modules import (``npugraph_ex._acl_concrete_graph.acl_graph.AclGraph``)."""
    acl_graph.install(dynamo_dir)
    from npugraph_ex._acl_concrete_graph import acl_graph as module  # type: ignore[import-not-found]

    if module.AclGraph is not ReplayedGraph:
        _REAL[:] = [module.AclGraph]
        module.AclGraph = ReplayedGraph
    _all_to_all_on_cpu()


def _all_to_all_rows(
    x: torch.Tensor,
    send_counts: list[int],
    send_displacements: list[int],
    recv_counts: list[int],
    recv_displacements: list[int],
    tag: str,
    ranks: list[int],
    group_size: int,
) -> torch.Tensor:
    """``npu_define.all_to_all_single_npu`` as npugraph_ex's meta kernel describes it: counts in elements, so rows
    of dim 0 are counts over the elements of a row."""
    import torch.distributed.distributed_c10d as c10d

    pg = c10d._find_or_create_pg_by_ranks_and_tag(tag, ranks, group_size)
    row = x[0].numel() if x.dim() > 1 and x.shape[0] else 1
    out = x.new_empty([sum(recv_counts) // row, *x.shape[1:]])
    c10d.all_to_all_single(
        out,
        x.contiguous(),
        output_split_sizes=[c // row for c in recv_counts],
        input_split_sizes=[c // row for c in send_counts],
        group=pg,
    )
    return out


def _all_to_all_on_cpu() -> None:
    """npugraph_ex registers ``npu_define.all_to_all_single_npu`` for the NPU only (``ops/_hcom_alltoall.py``); the
    replay runs it on the CPU as its meta kernel describes it (:func:`_all_to_all_rows`). npugraph_ex's own NPU
    kernel differs: it allocates ``sum(recv_counts)`` rows and hands the element counts to ``all_to_all_single`` as
    row counts, which matches its meta only for a 1-D input."""
    import npugraph_ex.ops._hcom_alltoall  # type: ignore[import-not-found]  # noqa: F401 - defines the op
    from npugraph_ex.ops._npu_define_lib import npu_define_lib  # type: ignore[import-not-found]

    name = torch.ops.npu_define.all_to_all_single_npu.default.name()
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"):
        npu_define_lib.impl("all_to_all_single_npu", _all_to_all_rows, "CPU")


def _real() -> Any:
    if not _REAL:
        raise RuntimeError("acl_replay.install() has not run in this process")
    return _REAL[0]


class ReplayedGraph:
    """npugraph_ex's ``AclGraph`` as its generated module makes it (``AclGraph(fx_forward=forward, config=...)``,
    then ``load(AclGraphCacheInfo(...))``), with the capture stood in (see the module docstring).

    ``calls``: per call, the ``data_ptr`` of every mutated user input (in :attr:`mutated` order); ``captures``: how
    many times it captured (the first call of a graph key, and every recapture); ``eager_calls``: calls run eagerly
    (``force_eager``, or after the capture limit).
    """

    def __init__(self, fx_graph: Any = None, fx_forward: Any = None, config: dict[str, Any] | None = None) -> None:
        if fx_forward is None:
            raise RuntimeError("the replay takes npugraph_ex's generated forward (AclGraph(fx_forward=...))")
        self._fx_forward = fx_forward
        self._config = dict(config or {})
        self._graphs_meta: dict[str, Any] = {}
        self._fx_graph_name = ""
        self._key_fn: Any = None
        self.mutated: list[tuple[str, int]] = []  # (placeholder name, argument index)
        self.calls: list[tuple[int, ...]] = []
        self.captures = 0
        self.eager_calls = 0
        self.fallback_to_eager = False
        self.capture_error_mode = ""

    # the attributes npugraph_ex's own methods read from ``self``
    @property
    def config(self) -> dict[str, Any]:
        return self._config

    @property
    def name(self) -> str:
        return self._fx_graph_name

    @property
    def graphs_meta(self) -> dict[str, Any]:
        return self._graphs_meta

    def load(self, info: Any) -> None:
        """Take what npugraph_ex's generated module hands over (its ``AclGraphCacheInfo``)."""
        from npugraph_ex._acl_concrete_graph.acl_graph import get_unupdated_input_fn  # type: ignore[import-not-found]

        self._fx_graph_name = info.fx_graph_name
        self.capture_error_mode = info.capture_error_mode  # what torch_npu.npu.graph would capture under
        mutated = set(info.mutated_user_inputs or ())
        self.mutated = [(name, idx) for name, idx in info.user_inputs_mapping.items() if name in mutated]
        self._key_fn = get_unupdated_input_fn(
            info.unupdated_sym_input_index or [], info.parameter_user_inputs or [], self.config
        )
        _GRAPHS.append(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(tuple(args[idx].data_ptr() for _, idx in self.mutated))
        if self.config.get("force_eager", False) or self.fallback_to_eager or not self._compile(*args):
            self.eager_calls += 1
        return self._fx_forward(*args, **kwargs)

    def _compile(self, *args: Any) -> bool:
        """``AclGraph.compile`` up to its capture: whether the call replays a captured graph (False: eager)."""
        from torch._dynamo.utils import counters

        key = self._key_fn(*args)
        if key in self._graphs_meta and not _real().is_need_to_recapture(self, key, *args):
            return True
        if len(self._graphs_meta) == int(self.config.get("capture_limit", "-1")):
            self.fallback_to_eager = True  # npugraph_ex warns, resets its graphs and runs eagerly from now on
            for what in ("captured_", "recapture_due_to_mutated_input_change_"):
                counters["npugraph_ex"].pop(what + self.name, None)
            self._graphs_meta = {}
            return False
        self._capture(key, *args)
        return True

    def _capture(self, key: str, *args: Any) -> None:
        """What ``compile_for_graph_key`` records before it captures: the graph's meta, the captured count, the
        mutated inputs' addresses and the stream's core limits."""
        from npugraph_ex._acl_concrete_graph.utils import GraphMeta  # type: ignore[import-not-found]
        from torch._dynamo.utils import counters

        self._graphs_meta[key] = GraphMeta(
            graph_key=key,
            acl_graph=None,
            replay_func=None,
            outputs_meta=[],
            outputs_weakref=[],
            mem_state_after_capture=None,
        )
        counters["npugraph_ex"]["captured_" + self.name] = len(self._graphs_meta)
        for _, idx in self.mutated:
            self._graphs_meta[key].captured_mutated_inputs.setdefault(idx, args[idx].data_ptr())
        _real()._save_stream_core_limits(self, key)
        self.captures += 1

    def counted(self) -> dict[str, int]:
        """npugraph_ex's own counts for this graph (dynamo's ``counters["npugraph_ex"]``)."""
        from torch._dynamo.utils import counters

        got = counters["npugraph_ex"]
        return {
            "graph_keys": int(got.get("captured_" + self.name, 0)),
            "recaptures": int(got.get("recapture_due_to_mutated_input_change_" + self.name, 0)),
            "recaptures_for_core_limits": int(got.get("recapture_due_to_global_limit_core_change_" + self.name, 0)),
            "forced_recaptures": int(got.get("recapture_due_to_force_recapture_" + self.name, 0)),
        }


def _labels(args: Sequence[Any], names: Sequence[str] | None) -> dict[int, str]:
    """``data_ptr`` -> the paths of the argument tensors there (``state.prefetched[1]``), as they are now."""
    out: dict[int, list[str]] = {}
    for i, arg in enumerate(args):
        head = names[i] if names is not None and i < len(names) else f"args[{i}]"
        leaves, _ = pytree.tree_flatten_with_path(arg)
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                out.setdefault(leaf.data_ptr(), []).append(head + pytree.keystr(path))
    return {ptr: "=".join(sorted(paths)) for ptr, paths in out.items()}


def replay(
    fn: Any, args: Sequence[Any], config: Any, steps: int, *, names: Sequence[str] | None = None
) -> dict[str, Any]:
    """Compile ``fn`` with npugraph_ex's backend under ``config`` and call it ``steps`` times with ``args``.

    Returns ``{"steps", "graphs": {graph name: ...}, "recaptures"}``; per graph (one per FX graph dynamo compiled):
    ``calls``; ``mutated_inputs`` (placeholder names); ``address_tuples``: the distinct tuples of their addresses, in
    the order first seen, each address named by the argument path that held it before the first call (``names``:
    the arguments' names; an address no argument held is ``new#<n>``); ``address_sequence``: per call, the index of
    its tuple; ``captures``; npugraph_ex's own counts
    (``graph_keys``, ``recaptures``, ``recaptures_for_core_limits``, ``forced_recaptures``, see
    :meth:`ReplayedGraph.counted`); ``eager_calls``; ``fallback_to_eager``; ``capture_error_mode`` (the ACL capture
    mode npugraph_ex's generated module hands to the capture). ``recaptures``: their sum over the graphs
    (each graph's first capture is not one). Run only in a process set up by :func:`install`.
    """
    from torch._dynamo.utils import counters

    labels = _labels(args, names)
    compiled = torch.compile(fn, backend=acl_graph.backend(config), fullgraph=True, dynamic=False)
    counters["npugraph_ex"].clear()
    before = len(_GRAPHS)
    acl_graph._AclGraph.stop = False
    try:
        with torch.no_grad():
            for _ in range(steps):
                compiled(*args)
    finally:
        acl_graph._AclGraph.stop = True
    unknown: dict[int, str] = {}

    def label(ptr: int) -> str:
        return labels.get(ptr) or unknown.setdefault(ptr, f"new#{len(unknown)}")

    graphs: dict[str, Any] = {}
    for g in _GRAPHS[before:]:
        tuples: list[list[str]] = []
        sequence = []
        for call in g.calls:
            named = [label(p) for p in call]
            if named not in tuples:
                tuples.append(named)
            sequence.append(tuples.index(named))
        graphs[g.name] = {
            "calls": len(g.calls),
            "mutated_inputs": [name for name, _ in g.mutated],
            "address_tuples": tuples,
            "address_sequence": sequence,
            "captures": g.captures,
            **g.counted(),
            "eager_calls": g.eager_calls,
            "fallback_to_eager": g.fallback_to_eager,
            "capture_error_mode": g.capture_error_mode,
        }
    total = sum(g["recaptures"] + g["recaptures_for_core_limits"] + g["forced_recaptures"] for g in graphs.values())
    return {"steps": steps, "graphs": graphs, "recaptures": total}


def recapture_problems(report: dict[str, Any]) -> list[str]:
    """The recapture check over a :func:`replay` report: one line per graph and cause for which npugraph_ex would
    capture a graph again after its first capture, and one per graph that falls back to eager."""
    out = []
    for name, g in report["graphs"].items():
        again = f"recapture: {name} is captured again {{}} time(s) in {g['calls']} calls"
        if g["recaptures"]:
            out.append(
                again.format(g["recaptures"]) + f": its mutated inputs came at {len(g['address_tuples'])} different "
                "address tuples (a ring slot or cache that moves between steps)"
            )
        if g["forced_recaptures"]:
            out.append(again.format(g["forced_recaptures"]) + ": force_recapture")
        if g["recaptures_for_core_limits"]:
            out.append(again.format(g["recaptures_for_core_limits"]) + ": its stream's core limits changed")
        if g["fallback_to_eager"]:
            out.append(f"recapture: {name} reached npugraph_ex's capture_limit and runs eagerly from then on")
    return out
