"""Weight prefetch for layer-sharded series, written in the forward as functional collectives.

Layer ``l``'s weight of a series lives on coordinate ``l % n`` of the series axis (see
:mod:`functional_npu.layer_shard`). Before layer ``l`` computes, the forward issues the broadcast
of layer ``l + k``'s weights from their owner (``_c10d_functional.broadcast``) and waits on layer
``l``'s right before using them. The first ``k`` layers of the next step are issued during the
last ``k`` layers of this one and handed over as carried state, ``prefetched``: a list the forward
replaces in place, like the KV cache it writes in place. ``k = len(prefetched) // len(series)``,
so the state fixes the schedule; ``k = 0`` (no state) is synchronous.

In eager mode the broadcasts return async tensors that are waited on at first use, so they
overlap; under inductor the order is kept by :class:`functional_npu.schedule.PrefetchSchedule`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from ..core.collectives import broadcast
from ..core.mesh import Mesh

__all__ = ["prefetch_step", "start", "carried", "issue", "hand_over", "drain", "check_prefetch_step"]

Weights = dict[str, torch.Tensor]


def _series(params: dict[str, Any]) -> dict[str, torch.Tensor]:
    return params.get("series") or {}


def check_prefetch_step(k: int, num_layers: int) -> int:
    """Validate a prefetch distance: ``0 <= k <= num_layers - 2`` (a ring of ``k + 1`` buffers)."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= max(0, num_layers - 2):
        raise ValueError(
            f"prefetch_step must be an int with 0 <= k <= num_layers - 2 = {num_layers - 2} (the model has {num_layers} layers), "
            f"got {k!r}; k = 0 is synchronous, k = 1 overlaps one layer"
        )
    return k


def prefetch_step(params: dict[str, Any], prefetched: list[torch.Tensor] | None) -> int:
    """The prefetch distance the carried state implies (0 with no state or no series)."""
    n = len(_series(params))
    if not n or not prefetched:
        return 0
    if len(prefetched) % n:
        raise ValueError(f"prefetched holds {len(prefetched)} tensors, not a multiple of the {n} layer-sharded series {list(_series(params))}")
    return len(prefetched) // n


def issue(params: dict[str, Any], layer: int, mesh: Mesh) -> dict[int, Weights]:
    """Start fetching layer ``layer``'s series weights (``layer >= L`` wraps: the next step's).

    Returns ``{layer: {leaf: tensor}}``, empty when nothing is layer-sharded.
    """
    series = _series(params)
    if not series:
        return {}
    axis = params["layer_shard"].axis
    n, me = mesh.axis_size(axis), mesh.axis_index(axis)
    num = len(params["layers"])
    l = layer % num
    out = {}
    for leaf, stacked in series.items():
        mine = stacked[l // n] if l % n == me else torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
        out[leaf] = broadcast(mine, mesh, axis, src=l % n)
    return {layer: out}


def start(params: dict[str, Any], mesh: Mesh, k: int) -> list[torch.Tensor]:
    """The carried state for the first step: layers ``0 .. k-1`` issued now (run on every rank)."""
    fetched = [issue(params, j, mesh).get(j, {}) for j in range(k)]
    return [w[leaf] for w in fetched for leaf in w]


def carried(params: dict[str, Any], prefetched: list[torch.Tensor] | None) -> dict[int, Weights]:
    """The carried weights by layer, each waited on where it is first used (a no-op if already done)."""
    leaves = list(_series(params))
    k = prefetch_step(params, prefetched)
    flat = [funcol.wait_tensor(t) for t in (prefetched or [])]
    return {j: dict(zip(leaves, flat[j * len(leaves) : (j + 1) * len(leaves)])) for j in range(k)}


def hand_over(ahead: dict[int, Weights], prefetched: list[torch.Tensor] | None, num_layers: int) -> None:
    """Put the next step's first ``k`` layers (issued as layers ``L .. L+k-1``) into ``prefetched``."""
    if prefetched:
        prefetched[:] = [w for j in sorted(ahead) if j >= num_layers for w in ahead[j].values()]


def drain(prefetched: list[torch.Tensor] | None) -> None:
    """Finish the broadcasts still in flight in a state that will not be used again (then empty it)."""
    for t in prefetched or []:
        funcol.wait_tensor(t)
    if prefetched:
        prefetched.clear()
