"""Where each layer's weights come from: local, or prefetched from their owner ``k`` layers ahead into a ring.

Layer ``l``'s weight of a layer-sharded series lives on coordinate ``l % n`` of the series axis (see
:mod:`functional_npu.parallel.layer_shard`). :func:`layer_weights` is what the decoder's layer loop
asks for layer ``i``'s weights: the local per-layer dict, merged with the series weights fetched by
broadcasts issued ``k`` layers ahead.

**The ring.** Fetched weights land in a ring of ``k + 1`` slots, one flat buffer per group of a slot (its layout, a
:class:`~.prefetch_ring.Ring`, answered once by :func:`~.prefetch_ring.ring_of`), allocated once outside the graph
(:meth:`~.prefetch_ring.Ring.new`) and passed in as the carried state ``prefetched``, like the KV cache. Each broadcast
writes its layer into a slot in place (:func:`functional_npu.core.collectives.broadcast_into`); nothing in the graph
allocates a prefetch buffer, so the bound is the ring's size whatever a compiler or an allocator does.

Asking for layer ``i`` issues the broadcast of layer ``v = i + k`` into its slot, once the residual stream
entering layer ``i`` exists (so after every read of layer ``i - 1``, the slot's previous contents), then waits
for layer ``i``'s slot. Layers ``v >= L`` are the next step's first ``k`` layers, left in flight across the step
boundary.

**Phases.** The slot of virtual layer ``v`` is ``(v + p) mod (k + 1)`` (:meth:`~.prefetch_ring.Ring.slot_of`), where
``p`` is the ring's phase (:class:`~.prefetch_ring.RingPhase`, carried in the decode state beside the ring). A step
leaves the next step's layer ``j`` in slot ``(j + L + p) mod (k + 1)``, so it advances the phase by ``L mod (k + 1)``;
the list of slots never changes order. A compiled step reads the phase as a constant, so the compiler makes one graph
per phase, at most :meth:`~.prefetch_ring.Ring.phases` ``= (k + 1) / gcd(L, k + 1)`` of them (one when ``k + 1`` divides
``L``), and each graph sees the same tensor at each of its slot inputs on every replay: a captured graph (npugraph_ex's
ACL graphs, CUDA graphs) records a mutated input's address once and never recaptures. Numbering every step from phase 0
without advancing puts a layer in a slot still in use when ``L`` is not a multiple of ``k + 1`` (the hazard
:mod:`functional_npu.checks.hazard` finds).

``k`` is the ring's (the placement's resolved ``plan.prefetch_step``); the state's buffers are checked to be that
ring's, never counted to find it. ``k = 0`` (one slot) is synchronous. Over an axis of size 1 every layer is local:
no ring, no broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from ..core.collectives import broadcast, broadcast_into, copy_into
from ..core.mesh import Mesh
from ..core.tree import flatten_with_paths, tree_from_paths
from .layer_shard import series_of
from .offload import check_no_host_series, host_of
from .plan import Plan
from .prefetch_ring import Ring, RingPhase, ring_of, ring_used
from .streams import INLINE, PREFETCH_STREAM, Streams

__all__ = ["layer_weights", "new_ring", "start", "drain", "check_prefetch_step", "ready"]

Weights = dict[str, torch.Tensor]


def check_prefetch_step(k: int, num_layers: int) -> int:
    """Validate a prefetch distance: ``0 <= k <= num_layers - 1`` (a ring of ``k + 1 <= L`` slots)."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= max(0, num_layers - 1):
        raise ValueError(
            f"prefetch_step must be an int with 0 <= k <= num_layers - 1 = {num_layers - 1} (the model has "
            f"{num_layers} layers, so a ring of k + 1 slots holds at most all of them), got {k!r}; k = 0 is "
            f"synchronous, k = 1 overlaps one layer, 'auto' lets the cost model choose"
        )
    return k


def _flat_series(params: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The series' tensors by dotted path (``o_proj``, or ``o_proj.w8`` and ``o_proj.scale`` when quantized)."""
    return dict(flatten_with_paths(series_of(params)))


def _device(params: dict[str, Any]) -> torch.device:
    """Where the ring lives: the device of the params' layers (host series stay in host memory)."""
    for x in (*_flat_series(params).values(), *(t for layer in params["layers"] for t in layer.values())):
        if isinstance(x, torch.Tensor):
            return x.device
    return next(t for _, t in flatten_with_paths(host_of(params))).device


def new_ring(params: dict[str, Any], mesh: Mesh, plan: Plan, k: int | None = None) -> list[torch.Tensor]:
    """Empty buffers for the ring of ``params`` (:func:`~.prefetch_ring.ring_of`, at ``k`` or the plan's step) on the
    params' device; ``[]`` when no layer arrives through a ring."""
    ring = ring_of(params, mesh, plan, k)
    return ring.new(_device(params)) if ring is not None else []


def _issue(
    params: dict[str, Any],
    ring: Ring,
    buffers: list[torch.Tensor],
    v: int,
    mesh: Mesh,
    after: torch.Tensor | None = None,
    streams: Streams = INLINE,
    phase: int = 0,
) -> list[torch.Tensor]:
    """Start fetching virtual layer ``v``'s series weights (``v >= L``: the next step's layer ``v - L``) into its
    slot, one write per group of ``ring`` (an in-place broadcast from the layer's owner, or a copy from host
    memory), on the prefetch stream, not before ``after`` exists, then marks :func:`ready` for the slot on that
    stream (the layer's first use waits for the mark). Returns the slot's buffers (in flight)."""
    n, me = (mesh.axis_size(ring.axis), mesh.axis_index(ring.axis)) if ring.axis is not None else (1, 0)
    li = v % ring.num_layers
    stacked = {"peer": _flat_series(params), "host": dict(flatten_with_paths(host_of(params)))}
    s = ring.slot_of(v, phase)
    gate = after if streams.gate else None
    out = []
    with streams.side(PREFETCH_STREAM):
        for g, group in enumerate(ring.groups):
            slot, series = ring.buffer(buffers, s, g), stacked[group.source]
            if group.source == "host":  # every layer is here, in host memory
                out.append(copy_into(slot, [series[leaf][li] for leaf in group.leaves], gate, streams.host_link))
                continue
            parts = [series[leaf][li // n] for leaf in group.leaves] if li % n == me else []
            out.append(broadcast_into(slot, parts, mesh, ring.axis, src=li % n, after=gate))
        streams.signal(ready(s))  # on the prefetch stream, after the slot's broadcasts
    return out


def ready(s: int) -> str:
    """The name of the mark after slot ``s``'s broadcasts (an event on a captured graph's prefetch stream)."""
    return f"{PREFETCH_STREAM}.slot{s}"


def _local(params: dict[str, Any], i: int) -> Weights:
    """Layer ``i``'s series weights where every layer is local (views of the stacked series)."""
    return tree_from_paths({leaf: stacked[i] for leaf, stacked in _flat_series(params).items()})


def layer_weights(
    params: dict[str, Any],
    prefetched: list[torch.Tensor],
    mesh: Mesh,
    plan: Plan,
    streams: Streams = INLINE,
    *,
    ring: Ring | None = None,
    phase: RingPhase | None = None,
    differentiable: bool = False,
) -> Callable[[int, torch.Tensor], Weights]:
    """The loop's source of weights: ``weights(i, x)`` is layer ``i``'s full weight dict, where ``x``
    is the residual stream entering layer ``i``; ask for ``i = 0, 1, ...`` in order.

    Without layer-sharded series it is ``params["layers"][i]``. With them, asking for layer ``i`` issues
    the broadcasts of layer ``i + k`` into the ring's buffers ``prefetched`` (after ``x``, under ``streams``) and
    waits for layer ``i``'s slot, in the slots of ``phase`` (read once, as a constant: a compiled step is a graph of
    that phase); asking for the last layer leaves the next step's first ``k`` layers in flight and advances
    ``phase`` for the next step. The list ``prefetched`` is never reordered.

    ``ring``: the ring's layout (:func:`~.prefetch_ring.ring_of`; a compiled model passes the one it answered at compile
    time, so nothing here reads the layout off the params); None: answered here from the params and ``plan``'s
    ``prefetch_step``. ``k`` is the layout's, never the buffers' count. An empty ``prefetched`` over an axis of
    size > 1 is a one-slot ring made here (``k = 0``: synchronous).

    Raises:
        ValueError: buffers that are not the ring's (:meth:`~.prefetch_ring.Ring.check`); a ring carried across steps
            (``prefetched``, ``L`` not a multiple of ``k + 1``) with no ``phase``.

    ``differentiable``: the weights are a gradient's inputs, so they arrive by out-of-place broadcasts
    (:func:`~functional_npu.core.collectives.broadcast`, whose gradient is summed back to the owner) issued
    ``plan.prefetch_step`` layers ahead in program order, not written into a ring; the
    backward holds every layer's weights, as any layer-sharded training step does (no ring bound).
    """
    layers = params["layers"]
    if not series_of(params) and not host_of(params):
        return lambda i, x: layers[i]
    if series_of(params) and plan.layer_shard is None:
        raise ValueError(
            f"the params hold layer-sharded series {list(series_of(params))}, but the plan shards no layers; pass the "
            f"plan they were loaded for (params.placement.plan)"
        )
    if not ring_used(params, mesh, plan):
        return lambda i, x: layers[i] | _local(params, i)
    if differentiable:
        check_no_host_series(params, "layer_weights")
        return _broadcast_weights(params, mesh, plan)
    if not prefetched:
        ring = ring_of(params, mesh, plan, 0)
        buffers = ring.new(_device(params))
    else:
        ring = ring if ring is not None else ring_of(params, mesh, plan)
        buffers = prefetched
    ring.check(buffers)
    k, L, groups = ring.k, ring.num_layers, range(len(ring.groups))
    if phase is None and prefetched and ring.next_phase(0) != 0:
        raise ValueError(
            f"prefetched: a ring of k + 1 = {k + 1} slots carried across steps of {L} layers needs its phase "
            f"(L mod (k + 1) = {L % (k + 1)}): pass the decode state's phase (DecodeState.phase, a RingPhase)"
        )
    p = phase.at if phase is not None else 0  # a constant of the graph: one graph per phase

    def weights(i: int, x: torch.Tensor) -> Weights:
        _issue(params, ring, buffers, i + k, mesh, x, streams, p)
        s = ring.slot_of(i, p)
        if i >= k:  # issued in this step (layers 0 .. k-1 came in flight from the last one, or from start())
            streams.wait(ready(s))
        flats = [funcol.wait_tensor(buffers[s * len(groups) + g]) for g in groups]
        cut = [f if f.numel() == grp.size else f[: grp.size] for f, grp in zip(flats, ring.groups)]
        layer = layers[i] | ring.unpack(cut)
        if i == L - 1 and prefetched:
            if not streams.hand_over:  # the compiler copies the slots back: let the copy read whole layers
                for v in range(L, L + k):
                    for g in groups:
                        funcol.wait_tensor(buffers[ring.slot_of(v, p) * len(groups) + g])
            if phase is not None:
                phase.at = ring.next_phase(p)
        return layer

    return weights


def _broadcast_weights(params: dict[str, Any], mesh: Mesh, plan: Plan) -> Callable[[int, torch.Tensor], Weights]:
    """:func:`layer_weights` for a gradient: layer ``i + k``'s series broadcast (out of place, differentiable) from
    its owner when layer ``i`` is asked for; non-owners send zeros of the layer's size, derived from their own
    series so that autograd records the broadcast on every rank (its backward is a collective)."""
    axis, k = plan.layer_shard.axis, plan.prefetch_step
    k = k if isinstance(k, int) else 1  # "auto" was resolved for inference; one layer ahead here
    n, me = mesh.axis_size(axis), mesh.axis_index(axis)
    series, layers = _flat_series(params), params["layers"]
    ring = ring_of(params, mesh, plan, k)
    issued: dict[int, list[torch.Tensor]] = {}

    def issue(v: int) -> None:
        if v >= len(layers) or v in issued:
            return
        out = []
        for group in ring.groups:
            leaves = group.leaves
            if v % n == me:
                flat = torch.cat([series[leaf][v // n].reshape(-1) for leaf in leaves])
            else:  # zeros that autograd tracks, so every rank takes the broadcast's backward (its all_reduce)
                flat = series[leaves[0]].new_zeros(group.size) + series[leaves[0]].reshape(-1)[:0].sum()
            out.append(broadcast(flat, mesh, axis, src=v % n))
        issued[v] = out

    def weights(i: int, x: torch.Tensor) -> Weights:
        for v in range(i, i + k + 1):
            issue(v)
        return layers[i] | ring.unpack(issued.pop(i))  # a collective's output waits where it is read

    return weights


def start(
    params: dict[str, Any], mesh: Mesh, ring: Ring | None, buffers: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The ring's buffers for the first step (``buffers``, else new ones on the params' device), with layers
    ``0 .. k-1`` issued into slots ``0 .. k-1`` now (run on every rank of the axis), for a step of phase 0 (a new
    :class:`~.prefetch_ring.RingPhase`); ``[]`` when ``ring`` is None (the series are local)."""
    if ring is None:
        return []
    buffers = ring.new(_device(params)) if buffers is None else buffers
    ring.check(buffers)
    for v in range(ring.k):
        _issue(params, ring, buffers, v, mesh)
    return buffers


def drain(prefetched: list[torch.Tensor]) -> None:
    """Finish the broadcasts still in flight in a ring that will not be used again (then empty it)."""
    for t in prefetched:
        funcol.wait_tensor(t)
    prefetched.clear()
