"""Where each layer's weights come from: local, or prefetched from their owner ``k`` layers ahead.

Layer ``l``'s weight of a layer-sharded series lives on coordinate ``l % n`` of the series axis (see
:mod:`functional_npu.parallel.layer_shard`). :func:`layer_weights` is what the decoder's layer loop
asks for layer ``i``'s weights: the local per-layer dict, merged with the series weights fetched by
broadcasts (``_c10d_functional.broadcast``) issued ``k`` layers ahead. Asking for layer ``i`` issues
the broadcast of layer ``i + k`` and returns layer ``i``'s weights, to be waited on at first use.
The first ``k`` layers of the next step are issued during the last ``k`` layers of this one and
handed over as carried state, ``prefetched``: a list replaced in place, like the KV cache written in
place. They are handed over in flight (a compiled step returns them unwaited), so they keep
arriving between steps and are waited on where the next step first reads them.
``k = len(prefetched) // len(series)``, so the state fixes the schedule; ``k = 0`` (empty state)
is synchronous.

In eager mode the broadcasts return async tensors that are waited on at first use, so they overlap;
under inductor the order is kept by :class:`functional_npu.parallel.schedule.PrefetchSchedule`.
For compilers that order the graph themselves (torchair's GE), the ordering is stated in the graph
with :class:`functional_npu.parallel.streams.Streams`: the broadcasts run on a side stream, and the
issue of layer ``i + k`` waits for the residual stream entering layer ``i`` (so for every use of
layer ``i - 1``'s weights): at most ``k + 1`` buffers per series are live, and nothing makes a
broadcast wait for more than that.

One layer's weights travel together: the layer-sharded leaves of one dtype are packed into one flat
buffer (a copy on the owner, views on every rank), one broadcast per layer (:func:`coalesced`), and
the carried state holds those flat buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from ..core.collectives import broadcast, broadcast_in_flight
from ..core.mesh import Mesh
from ..core.tree import flatten_with_paths, tree_from_paths
from .layer_shard import series_of
from .streams import INLINE, PREFETCH_STREAM, Streams

__all__ = ["layer_weights", "prefetch_step", "coalesced", "start", "drain", "check_prefetch_step"]

Weights = dict[str, torch.Tensor]


def check_prefetch_step(k: int, num_layers: int) -> int:
    """Validate a prefetch distance: ``0 <= k <= num_layers - 2`` (a ring of ``k + 1`` buffers)."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= max(0, num_layers - 2):
        raise ValueError(
            f"prefetch_step must be an int with 0 <= k <= num_layers - 2 = {num_layers - 2} (the "
            f"model has {num_layers} layers), got {k!r}; k = 0 is synchronous, k = 1 overlaps one layer, "
            f"'auto' lets the cost model choose"
        )
    return k


def _flat_series(params: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The series' tensors by dotted path (``o_proj``, or ``o_proj.w8`` and ``o_proj.scale`` when quantized)."""
    return dict(flatten_with_paths(series_of(params)))


def coalesced(params: dict[str, Any]) -> list[tuple[str, ...]]:
    """The layer-sharded tensors (dotted paths in the series) grouped so that one layer's weights travel in
    one broadcast per group: one group per dtype (a flat buffer of that dtype), in series order."""
    groups: dict[torch.dtype, list[str]] = {}
    for leaf, stacked in _flat_series(params).items():
        groups.setdefault(stacked.dtype, []).append(leaf)
    return [tuple(g) for g in groups.values()]


def prefetch_step(params: dict[str, Any], prefetched: list[torch.Tensor]) -> int:
    """The prefetch distance the carried state implies (0 with no state or no series)."""
    n = len(coalesced(params))
    if not n or not prefetched:
        return 0
    if len(prefetched) % n:
        raise ValueError(
            f"prefetched holds {len(prefetched)} tensors, not a multiple of the {n} coalesced broadcasts "
            f"per layer of the layer-sharded series {list(series_of(params))}"
        )
    return len(prefetched) // n


def _issue(
    params: dict[str, Any],
    layer: int,
    mesh: Mesh,
    after: torch.Tensor | None = None,
    streams: Streams = INLINE,
    carry: bool = False,
) -> dict[int, list[torch.Tensor]]:
    """Start fetching layer ``layer``'s series weights (``layer >= L`` wraps: the next step's), one flat
    buffer per :func:`coalesced` group: ``{layer: [flat, ...]}``, on the prefetch stream and, given
    ``after``, not before it exists. The next step's layers are left in flight
    (:func:`functional_npu.core.collectives.broadcast_in_flight`): a compiled step hands them over
    unwaited, so they keep arriving until the next step first reads them."""
    axis = params["plan"].layer_shard.axis
    n, me = mesh.axis_size(axis), mesh.axis_index(axis)
    li = layer % len(params["layers"])
    carried = carry or layer >= len(params["layers"])
    series = _flat_series(params)
    out = []
    with streams.side(PREFETCH_STREAM):
        for leaves in coalesced(params):
            first = series[leaves[0]]
            if li % n == me:
                parts = [series[leaf][li // n].reshape(-1) for leaf in leaves]
                flat = parts[0] if len(parts) == 1 else torch.cat(parts)
            else:
                size = sum(math.prod(series[leaf].shape[1:]) for leaf in leaves)
                flat = torch.empty(size, dtype=first.dtype, device=first.device)
            fetch = broadcast_in_flight if carried else broadcast
            out.append(fetch(flat if after is None else streams.after(flat, after), mesh, axis, src=li % n))
    return {layer: out}


def _unpack(params: dict[str, Any], flats: list[torch.Tensor]) -> Weights:
    """The per-leaf views of one layer's coalesced buffers (a quantized leaf's as the dict of its tensors)."""
    series = _flat_series(params)
    out = {}
    for leaves, flat in zip(coalesced(params), flats):
        shapes = [series[leaf].shape[1:] for leaf in leaves]
        parts = flat.split([math.prod(s) for s in shapes]) if len(leaves) > 1 else [flat]
        out |= {leaf: part.view(shape) for leaf, part, shape in zip(leaves, parts, shapes)}
    return tree_from_paths(out)


def _carried(params: dict[str, Any], prefetched: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """The carried buffers by layer, each waited on where it is first used (a no-op if already done)."""
    n = len(coalesced(params))
    flat = [funcol.wait_tensor(t) for t in prefetched]
    return {j: flat[j * n : (j + 1) * n] for j in range(prefetch_step(params, prefetched))}


def layer_weights(
    params: dict[str, Any], prefetched: list[torch.Tensor], mesh: Mesh, streams: Streams = INLINE
) -> Callable[[int, torch.Tensor], Weights]:
    """The loop's source of weights: ``weights(i, x)`` is layer ``i``'s full weight dict, where ``x``
    is the residual stream entering layer ``i``; ask for ``i = 0, 1, ...`` in order.

    Without layer-sharded series it is ``params["layers"][i]``. With them, asking for layer ``i``
    issues the broadcasts of layer ``i + k`` (after ``x``, under ``streams``); asking for the last
    layer also hands the next step's first ``k`` layers over into ``prefetched`` (in place).
    """
    layers = params["layers"]
    if not series_of(params):
        return lambda i, x: layers[i]
    k = prefetch_step(params, prefetched)
    ahead = _carried(params, prefetched)

    def weights(i: int, x: torch.Tensor) -> Weights:
        ahead.update(_issue(params, i + k, mesh, x, streams))
        layer = layers[i] | _unpack(params, ahead.pop(i))
        if i == len(layers) - 1 and prefetched:  # the next step's first k layers, issued as layers L .. L+k-1
            prefetched[:] = [flat for j in sorted(ahead) for flat in ahead[j]]
        return layer

    return weights


def start(params: dict[str, Any], mesh: Mesh, k: int) -> list[torch.Tensor]:
    """The carried state for the first step: layers ``0 .. k-1`` issued now (run on every rank of the axis)."""
    if not series_of(params):
        return []
    return [flat for j in range(k) for flat in _issue(params, j, mesh, carry=True)[j]]


def drain(prefetched: list[torch.Tensor]) -> None:
    """Finish the broadcasts still in flight in a state that will not be used again (then empty it)."""
    for t in prefetched:
        funcol.wait_tensor(t)
    prefetched.clear()
