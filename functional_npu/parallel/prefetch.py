"""Where each layer's weights come from: local, or prefetched from their owner ``k`` layers ahead into a ring.

Layer ``l``'s weight of a layer-sharded series lives on coordinate ``l % n`` of the series axis (see
:mod:`functional_npu.parallel.layer_shard`). :func:`layer_weights` is what the decoder's layer loop
asks for layer ``i``'s weights: the local per-layer dict, merged with the series weights fetched by
broadcasts issued ``k`` layers ahead.

**The ring.** Fetched weights land in a ring of ``k + 1`` slots per coalesced group (one flat buffer
per dtype, :func:`coalesced`), allocated once outside the graph (:func:`new_ring`) and passed in as
the carried state ``prefetched``, like the KV cache. Each broadcast writes its layer into a slot in
place (:func:`functional_npu.core.collectives.broadcast_into`); nothing in the graph allocates a
prefetch buffer, so the bound is the ring's size whatever a compiler or an allocator does.

Asking for layer ``i`` issues the broadcast of layer ``v = i + k`` into its slot, once the residual stream
entering layer ``i`` exists (so after every read of layer ``i - 1``, the slot's previous contents), then waits
for layer ``i``'s slot. Layers ``v >= L`` are the next step's first ``k`` layers, left in flight across the step
boundary.

**Phases.** The slot of virtual layer ``v`` is ``(v + p) mod (k + 1)`` (:func:`slot_of`), where ``p`` is the ring's
phase (:class:`RingPhase`, carried in the decode state beside the ring). A step leaves the next step's layer
``j`` in slot ``(j + L + p) mod (k + 1)``, so it advances the phase by ``L mod (k + 1)``; the list of slots never
changes order. A compiled step reads the phase as a constant, so the compiler makes one graph per phase, at most
:func:`phases` ``= (k + 1) / gcd(L, k + 1)`` of them (one when ``k + 1`` divides ``L``), and each graph sees the same
tensor at each of its slot inputs on every replay: a captured graph (npugraph_ex's ACL graphs, CUDA graphs) records
a mutated input's address once and never recaptures. Numbering every step from phase 0 without advancing puts a
layer in a slot still in use when ``L`` is not a multiple of ``k + 1`` (the hazard
:mod:`functional_npu.checks.hazard` finds).

``k = len(prefetched) // groups - 1``, so the state fixes the schedule; ``k = 0`` (one slot) is
synchronous. Over an axis of size 1 every layer is local: no ring, no broadcast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from ..core.collectives import broadcast, broadcast_into, copy_into
from ..core.mesh import Mesh
from ..core.tree import flatten_with_paths, tree_from_paths
from .layer_shard import series_of
from .offload import check_no_host_series, host_of
from .plan import Plan
from .streams import INLINE, PREFETCH_STREAM, Streams

__all__ = [
    "layer_weights",
    "ring_used",
    "coalesced",
    "slot_of",
    "RingPhase",
    "phases",
    "next_phase",
    "ring_spec",
    "new_ring",
    "check_ring",
    "start",
    "drain",
    "check_prefetch_step",
    "ready",
]

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


@dataclass
class RingPhase:
    """The phase ``at`` of a prefetch ring (see the module docstring): virtual layer ``v`` of the next step is in
    slot ``(v + at) mod (k + 1)``. The step's forward advances it (:func:`next_phase`); a new ring starts at 0."""

    at: int = 0


def slot_of(v: int, k: int, phase: int = 0) -> int:
    """The ring slot of virtual layer ``v`` (``v >= L``: the next step's layer ``v - L``) at prefetch step ``k`` in a
    step of phase ``phase``."""
    return (v + phase) % (k + 1)


def next_phase(phase: int, num_layers: int, k: int) -> int:
    """The phase of the step after one of phase ``phase``: its layer ``j`` is this step's virtual layer ``j + L``."""
    return (phase + num_layers) % (k + 1)


def phases(num_layers: int, k: int) -> int:
    """How many phases a ring of ``k + 1`` slots goes through over steps of ``L`` layers (from phase 0): the graphs
    a compiled step needs, ``(k + 1) / gcd(L, k + 1)``."""
    return (k + 1) // math.gcd(num_layers, k + 1)


def _flat_series(params: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The series' tensors by dotted path (``o_proj``, or ``o_proj.w8`` and ``o_proj.scale`` when quantized)."""
    return dict(flatten_with_paths(series_of(params)))


def _ringed(params: dict[str, Any]) -> dict[str, tuple[str, torch.Tensor]]:
    """Every series the ring carries by dotted path: its source (``"peer"``: layer-sharded, a broadcast from the
    layer's owner; ``"host"``: kept in host memory, :mod:`.offload`) and its stacked tensor."""
    out = {leaf: ("peer", x) for leaf, x in flatten_with_paths(series_of(params))}
    return out | {leaf: ("host", x) for leaf, x in flatten_with_paths(host_of(params))}


def coalesced(params: dict[str, Any]) -> list[tuple[str, ...]]:
    """The ring's tensors (dotted paths in the series) grouped so that one layer's weights travel in one write per
    group: one group per source and dtype (a flat buffer of that dtype), layer-sharded series first, in series
    order."""
    groups: dict[tuple[str, torch.dtype], list[str]] = {}
    for leaf, (source, stacked) in _ringed(params).items():
        groups.setdefault((source, stacked.dtype), []).append(leaf)
    return [tuple(g) for g in groups.values()]


def ring_spec(params: dict[str, Any]) -> list[tuple[int, torch.dtype]]:
    """One slot's buffers: ``(elements, dtype)`` per coalesced group, each the size of one layer's weights."""
    series = _ringed(params)
    return [
        (sum(math.prod(series[leaf][1].shape[1:]) for leaf in leaves), series[leaves[0]][1].dtype)
        for leaves in coalesced(params)
    ]


def ring_used(params: dict[str, Any], mesh: Mesh, plan: Plan) -> bool:
    """Whether layers arrive through the ring within a step: series kept in host memory, or layer-sharded series
    over an axis of more than one rank (``plan``: the plan the params were loaded for)."""
    if host_of(params):
        return True
    return bool(series_of(params)) and mesh.axis_size(plan.layer_shard.axis) > 1


def _device(params: dict[str, Any]) -> torch.device:
    """Where the ring lives: the device of the params' layers (host series stay in host memory)."""
    for x in (*_flat_series(params).values(), *(t for layer in params["layers"] for t in layer.values())):
        if isinstance(x, torch.Tensor):
            return x.device
    return next(iter(_ringed(params).values()))[1].device


def _axis(plan: Plan) -> str | None:
    """The layer-sharded series' axis (None: only host series ride the ring)."""
    return plan.layer_shard.axis if plan.layer_shard is not None else None


def new_ring(params: dict[str, Any], mesh: Mesh, plan: Plan, k: int) -> list[torch.Tensor]:
    """An empty ring of ``k + 1`` slots (``[]`` when the series are local: no series, or an axis of size 1, and
    none in host memory). Slot ``s`` group ``g`` is ``ring[s * groups + g]``."""
    if not ring_used(params, mesh, plan):
        return []
    device = _device(params)
    return [torch.empty(size, dtype=dtype, device=device) for _ in range(k + 1) for size, dtype in ring_spec(params)]


def check_ring(params: dict[str, Any], mesh: Mesh, plan: Plan, ring: list[torch.Tensor], k: int | None = None) -> int:
    """The prefetch step a ring implies, after checking it holds ``k + 1`` slots (of the given ``k``) each able to
    hold one layer of every series.

    Raises:
        ValueError naming the series, the slot and the sizes, for a ring of the wrong count, size or dtype.
    """
    if not ring_used(params, mesh, plan):
        if ring:
            raise ValueError(
                f"prefetched: the series are local (no layer-sharded axis > 1), yet got a ring of {len(ring)}"
            )
        return 0 if k is None else k
    spec, groups = ring_spec(params), coalesced(params)
    slots, extra = divmod(len(ring), len(spec))
    if extra or not slots or (k is not None and slots != k + 1):
        want = f"{(k + 1) * len(spec)} = (k + 1 = {k + 1}) x" if k is not None else "a multiple of"
        raise ValueError(
            f"prefetched: a ring of {len(ring)} buffers; expected {want} {len(spec)} per slot (one per dtype of the "
            f"layer-sharded series {list(series_of(params))}); make it with new_state() or prefetch.new_ring"
        )
    for i, t in enumerate(ring):
        size, dtype = spec[i % len(spec)]
        if t.dtype != dtype or t.dim() != 1 or t.numel() < size or not t.is_contiguous():
            raise ValueError(
                f"prefetched: ring slot {i // len(spec)} buffer for series {list(groups[i % len(spec)])} is "
                f"{tuple(t.shape)} {t.dtype}; one layer needs a contiguous flat buffer of {size} {dtype}"
            )
    return slots - 1


def _issue(
    params: dict[str, Any],
    axis: str | None,
    ring: list[torch.Tensor],
    v: int,
    k: int,
    mesh: Mesh,
    after: torch.Tensor | None = None,
    streams: Streams = INLINE,
    phase: int = 0,
) -> list[torch.Tensor]:
    """Start fetching virtual layer ``v``'s series weights (``v >= L``: the next step's layer ``v - L``) into its
    slot, one write per :func:`coalesced` group (an in-place broadcast from the layer's owner, or a copy from host
    memory), on the prefetch stream, not before ``after`` exists, then marks :func:`ready` for the slot on that
    stream (the layer's first use waits for the mark). Returns the slot's buffers (in flight)."""
    n, me = (mesh.axis_size(axis), mesh.axis_index(axis)) if axis is not None else (1, 0)
    li = v % len(params["layers"])
    series, groups = _ringed(params), coalesced(params)
    s = slot_of(v, k, phase)
    gate = after if streams.gate else None
    out = []
    with streams.side(PREFETCH_STREAM):
        for g, leaves in enumerate(groups):
            slot = ring[s * len(groups) + g]
            size = sum(math.prod(series[leaf][1].shape[1:]) for leaf in leaves)
            slot = slot if slot.numel() == size else slot[:size]
            if series[leaves[0]][0] == "host":  # every layer is here, in host memory
                out.append(copy_into(slot, [series[leaf][1][li] for leaf in leaves], gate, streams.host_link))
                continue
            parts = [series[leaf][1][li // n] for leaf in leaves] if li % n == me else []
            out.append(broadcast_into(slot, parts, mesh, axis, src=li % n, after=gate))
        streams.signal(ready(s))  # on the prefetch stream, after the slot's broadcasts
    return out


def ready(s: int) -> str:
    """The name of the mark after slot ``s``'s broadcasts (an event on a captured graph's prefetch stream)."""
    return f"{PREFETCH_STREAM}.slot{s}"


def _unpack(params: dict[str, Any], flats: list[torch.Tensor]) -> Weights:
    """The per-leaf views of one layer's coalesced buffers (a quantized leaf's as the dict of its tensors)."""
    series = _ringed(params)
    out = {}
    for leaves, flat in zip(coalesced(params), flats):
        shapes = [series[leaf][1].shape[1:] for leaf in leaves]
        parts = flat.split([math.prod(s) for s in shapes]) if len(leaves) > 1 else [flat]
        out |= {leaf: part.view(shape) for leaf, part, shape in zip(leaves, parts, shapes)}
    return tree_from_paths(out)


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
    phase: RingPhase | None = None,
    differentiable: bool = False,
) -> Callable[[int, torch.Tensor], Weights]:
    """The loop's source of weights: ``weights(i, x)`` is layer ``i``'s full weight dict, where ``x``
    is the residual stream entering layer ``i``; ask for ``i = 0, 1, ...`` in order.

    Without layer-sharded series it is ``params["layers"][i]``. With them, asking for layer ``i`` issues
    the broadcasts of layer ``i + k`` into the ring ``prefetched`` (after ``x``, under ``streams``) and
    waits for layer ``i``'s slot, in the slots of ``phase`` (read once, as a constant: a compiled step is a graph of
    that phase); asking for the last layer leaves the next step's first ``k`` layers in flight and advances
    ``phase`` for the next step. The list ``prefetched`` is never reordered. An empty ring over an axis of size
    > 1 is a one-slot ring made here (synchronous; a compiled model always passes its own).

    Raises:
        ValueError: a ring carried across steps (``prefetched``, ``L`` not a multiple of ``k + 1``) with no
            ``phase``.

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
    ring = prefetched if prefetched else new_ring(params, mesh, plan, 0)
    k, axis = check_ring(params, mesh, plan, ring), _axis(plan)
    groups, L = len(coalesced(params)), len(layers)
    sizes = [size for size, _ in ring_spec(params)]
    if phase is None and prefetched and next_phase(0, L, k) != 0:
        raise ValueError(
            f"prefetched: a ring of k + 1 = {k + 1} slots carried across steps of {L} layers needs its phase "
            f"(L mod (k + 1) = {L % (k + 1)}): pass the decode state's phase (DecodeState.phase, a RingPhase)"
        )
    p = phase.at if phase is not None else 0  # a constant of the graph: one graph per phase

    def weights(i: int, x: torch.Tensor) -> Weights:
        _issue(params, axis, ring, i + k, k, mesh, x, streams, p)
        s = slot_of(i, k, p)
        if i >= k:  # issued in this step (layers 0 .. k-1 came in flight from the last one, or from start())
            streams.wait(ready(s))
        flats = [funcol.wait_tensor(ring[s * groups + g]) for g in range(groups)]
        layer = layers[i] | _unpack(params, [f if f.numel() == n else f[:n] for f, n in zip(flats, sizes)])
        if i == L - 1 and prefetched:
            if not streams.hand_over:  # the compiler copies the slots back: let the copy read whole layers
                for v in range(L, L + k):
                    for g in range(groups):
                        funcol.wait_tensor(ring[slot_of(v, k, p) * groups + g])
            if phase is not None:
                phase.at = next_phase(p, L, k)
        return layer

    return weights


def _broadcast_weights(params: dict[str, Any], mesh: Mesh, plan: Plan) -> Callable[[int, torch.Tensor], Weights]:
    """:func:`layer_weights` for a gradient: layer ``i + k``'s series broadcast (out of place, differentiable) from
    its owner when layer ``i`` is asked for; non-owners send zeros of the layer's size, derived from their own
    series so that autograd records the broadcast on every rank (its backward is a collective)."""
    axis, k = plan.layer_shard.axis, plan.prefetch_step
    k = k if isinstance(k, int) else 1  # "auto" was resolved for inference; one layer ahead here
    n, me = mesh.axis_size(axis), mesh.axis_index(axis)
    series, groups, layers = _flat_series(params), coalesced(params), params["layers"]
    sizes = [size for size, _ in ring_spec(params)]
    issued: dict[int, list[torch.Tensor]] = {}

    def issue(v: int) -> None:
        if v >= len(layers) or v in issued:
            return
        out = []
        for leaves, size in zip(groups, sizes):
            if v % n == me:
                flat = torch.cat([series[leaf][v // n].reshape(-1) for leaf in leaves])
            else:  # zeros that autograd tracks, so every rank takes the broadcast's backward (its all_reduce)
                flat = series[leaves[0]].new_zeros(size) + series[leaves[0]].reshape(-1)[:0].sum()
            out.append(broadcast(flat, mesh, axis, src=v % n))
        issued[v] = out

    def weights(i: int, x: torch.Tensor) -> Weights:
        for v in range(i, i + k + 1):
            issue(v)
        return layers[i] | _unpack(params, issued.pop(i))  # a collective's output waits where it is read

    return weights


def start(
    params: dict[str, Any], mesh: Mesh, plan: Plan, k: int, ring: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The ring for the first step (``ring``, else a new one), with layers ``0 .. k-1`` issued into slots
    ``0 .. k-1`` now (run on every rank of the axis), for a step of phase 0 (a new :class:`RingPhase`); ``[]`` when
    the series are local."""
    ring = new_ring(params, mesh, plan, k) if ring is None else ring
    for v in range(k if ring else 0):
        _issue(params, _axis(plan), ring, v, k, mesh)
    return ring


def drain(prefetched: list[torch.Tensor]) -> None:
    """Finish the broadcasts still in flight in a ring that will not be used again (then empty it)."""
    for t in prefetched:
        funcol.wait_tensor(t)
    prefetched.clear()
