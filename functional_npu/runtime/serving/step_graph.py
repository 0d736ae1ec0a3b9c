"""The library's own device graph around a step, for a model whose ring copies series from host memory on a GPU.

Inductor's CUDA graphs skip (run uncaptured) a graph with host tensor inputs, and a model that keeps series in host
memory (``Plan.offload``) has them: its ring copies each layer from pinned host memory into a slot on the device
(:mod:`functional_npu.parallel.offload`). Such a model compiles with inductor without CUDA graphs, and
:class:`StepGraphs` captures each step's call itself. For each step key (:func:`step_key`: the forward, the inputs'
shapes, the ring's phase, the addresses of the state's cache and ring):

1. the first call runs as is: inductor compiles, lazily made handles are made; it is the step's own run;
2. the second call captures: the inputs that change per step (tokens, positions, the prefill's ``last``) are copied
   into buffers of the graph's own; the compiled call is captured from the model's memory pool; before the capture
   ends, the ring's copies still in flight on the side stream (the next step's first ``k`` layers, issued at this
   step's last layers, :mod:`functional_npu.core.side_copy`) are joined, since a capture must end with every stream
   it forked joined; the phase the call leaves the ring in is kept; then the graph is replayed;
3. every later call copies its inputs into those buffers, joins the copies issued outside any graph (``new_state``
   issues the first ``k`` layers eagerly), replays the graph, and sets the ring's phase.

A replay runs no Python. Hence the ring's phase is set here (the forward advances it as a Python side effect), the
state's tensors must be the ones captured (their addresses are in the key, and ``new_state`` keeps one cache per bucket
and one ring per model), the weights too (``with_params`` starts new graphs), and the output is the graph's own
buffer, overwritten by the next replay (copied out here). What the join costs: the next step's first ``k`` layers are
waited for at the end of this step instead of at their first read in the next one; between the two, the compute stream
only launches the next replay.

``api`` is the device's module (``torch.cuda``: ``CUDAGraph``, ``graph``, ``graph_pool_handle``). A test stands in a
module that records the ops of a capture and replays them on the captured tensors, running no Python, and runs these
lines on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ...models.decoder import DecodeState

__all__ = ["StepGraphs", "Captured", "step_key", "join_ring"]


@dataclass(frozen=True)
class Captured:
    """One captured step: its graph, the buffers its per-step inputs are copied into, its output buffer, and the
    ring's phase after the step (None: no ring)."""

    graph: Any
    inputs: tuple[torch.Tensor, ...]
    out: torch.Tensor
    phase: int | None


def step_key(forward: Callable, inputs: Sequence[torch.Tensor], state: DecodeState) -> tuple:
    """What one captured graph serves: the forward, the per-step inputs' shapes and dtypes, the ring's phase, and the
    address of every tensor of the state (its cache, paged or not, and its ring's slots)."""
    shapes = tuple((tuple(x.shape), x.dtype) for x in inputs)
    addresses = tuple(t.data_ptr() for t in pytree.tree_leaves((state.kv, state.prefetched)))
    return id(forward), shapes, state.phase.at, addresses


def join_ring(prefetched: Sequence[torch.Tensor]) -> None:
    """Make the current stream wait for every ring copy still in flight (a slot's pending work from the side stream,
    :class:`~functional_npu.core.side_copy.EventWork`); a slot with none returns at once."""
    for slot in prefetched:
        torch.ops._c10d_functional.wait_tensor(slot)


@dataclass(eq=False)
class StepGraphs:
    """Each step of one model captured into a graph of ``api`` on its second call and replayed from its third (see the
    module docstring). Its graphs share one memory pool: they replay one at a time on one stream, and each output is
    copied out before the next replay."""

    api: Any
    pool: Any = None
    warm: set = field(default_factory=set)
    graphs: dict = field(default_factory=dict)

    def __call__(
        self,
        forward: Callable,
        params: dict,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        state: DecodeState,
        mesh: Any,
        *last: torch.Tensor,
    ) -> torch.Tensor:
        inputs = (tokens, positions, *last)
        key = step_key(forward, inputs, state)
        captured = self.graphs.get(key)
        if captured is None:
            if key not in self.warm:
                self.warm.add(key)
                return forward(params, tokens, positions, state, mesh, *last)
            captured = self.graphs[key] = self._capture(forward, params, inputs, state, mesh)
        return self._replay(captured, inputs, state)

    def _replay(self, captured: Captured, inputs: Sequence[torch.Tensor], state: DecodeState) -> torch.Tensor:
        for buffer, x in zip(captured.inputs, inputs):
            buffer.copy_(x)  # on the stream the last replay ran on: after it has read the buffer
        join_ring(state.prefetched)
        captured.graph.replay()
        if captured.phase is not None:
            state.phase.at = captured.phase
        return captured.out.clone()  # the graph's buffer, which the next replay overwrites

    def _capture(
        self, forward: Callable, params: dict, inputs: tuple[torch.Tensor, ...], state: DecodeState, mesh: Any
    ) -> Captured:
        join_ring(state.prefetched)  # a capture may not wait for work issued outside it
        buffers = tuple(x.clone() for x in inputs)
        if self.pool is None:
            self.pool = self.api.graph_pool_handle()
        graph = self.api.CUDAGraph()
        before = state.phase.at
        with self.api.graph(graph, pool=self.pool):
            out = forward(params, buffers[0], buffers[1], state, mesh, *buffers[2:])
            join_ring(state.prefetched)  # every copy forked onto the side stream joins before the capture ends
        after, state.phase.at = state.phase.at, before  # the capture ran nothing: the replay runs the step
        return Captured(graph, buffers, out, after if state.prefetched else None)
