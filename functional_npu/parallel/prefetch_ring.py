"""The prefetch ring's layout: which tensors ride it, in which flat buffers, how many slots, and ``k``.

A :class:`Ring` is answered once for placed params (:func:`ring_of`, by ``compile_model`` from the params in the
forms its graphs read) and then carried: the compiled forward takes it as a constant, ``new_state`` makes its
buffers, each step checks the state's buffers against it (their count, dtypes and sizes; nothing is read from the
params). Its ``k`` is the placement's resolved ``plan.prefetch_step``: the one form the schedule reads (never the
buffers' count).

**Groups.** One layer's weights travel in one write per group: one group per source (``"peer"``: a layer-sharded
series, broadcast from the layer's owner; ``"host"``: a series kept in host memory, :mod:`.offload`) and dtype, a
flat buffer of that dtype holding the group's leaves one after another; layer-sharded series first, in series
order. A slot is one buffer per group; the ring is ``k + 1`` slots, slot ``s`` group ``g`` at ``buffers[s * groups +
g]``.

**Phases.** The slot of virtual layer ``v`` is ``(v + p) mod (k + 1)`` (:meth:`Ring.slot_of`), ``p`` the ring's
phase (:class:`RingPhase`); a step of ``L`` layers advances it by ``L mod (k + 1)``, so a compiled step is one
graph per phase, :meth:`Ring.phases` ``= (k + 1) / gcd(L, k + 1)`` of them (see :mod:`.prefetch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core.mesh import Mesh
from ..core.tree import flatten_with_paths, tree_from_paths
from .layer_shard import series_of
from .offload import host_of
from .plan import Plan

__all__ = ["Ring", "RingGroup", "RingPhase", "ring_of", "ring_used", "coalesced", "phases", "slot_of", "next_phase"]


@dataclass
class RingPhase:
    """The phase ``at`` of a prefetch ring: virtual layer ``v`` of the next step is in slot ``(v + at) mod (k + 1)``.
    The step's forward advances it (:func:`next_phase`); a new ring starts at 0."""

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


@dataclass(frozen=True)
class RingGroup:
    """One flat buffer of a slot: the ``leaves`` (dotted paths in the series, or in the host series) of one
    ``source`` and ``dtype``, with one layer's shape of each, packed one after another."""

    source: str
    dtype: torch.dtype
    leaves: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        """Elements of one layer of the group's leaves: the buffer's length."""
        return sum(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class Ring:
    """The layout of a prefetch ring (see the module docstring): ``k``, the model's ``num_layers``, the layer-sharded
    series' mesh ``axis`` (None: only host series ride it) and the :class:`RingGroup` of each buffer of a slot."""

    k: int
    num_layers: int
    axis: str | None
    groups: tuple[RingGroup, ...]

    @property
    def slots(self) -> int:
        return self.k + 1

    @property
    def buffers(self) -> int:
        """How many flat buffers the ring is: ``(k + 1) x groups``."""
        return self.slots * len(self.groups)

    @property
    def phases(self) -> int:
        """The graphs a compiled step needs, one per phase: ``(k + 1) / gcd(L, k + 1)``."""
        return phases(self.num_layers, self.k)

    def slot_of(self, v: int, phase: int = 0) -> int:
        return slot_of(v, self.k, phase)

    def next_phase(self, phase: int) -> int:
        return next_phase(phase, self.num_layers, self.k)

    def buffer(self, buffers: list[torch.Tensor], slot: int, group: int) -> torch.Tensor:
        """Group ``group``'s buffer of slot ``slot``, cut to one layer's elements."""
        flat = buffers[slot * len(self.groups) + group]
        size = self.groups[group].size
        return flat if flat.numel() == size else flat[:size]

    def new(self, device: torch.device | str) -> list[torch.Tensor]:
        """Empty buffers for the ``k + 1`` slots on ``device`` (slot ``s`` group ``g`` is ``[s * groups + g]``)."""
        return [torch.empty(g.size, dtype=g.dtype, device=device) for _ in range(self.slots) for g in self.groups]

    def check(self, buffers: list[torch.Tensor], where: str = "prefetched") -> None:
        """Refuse buffers that are not this ring's: another count (a ring of another ``k``), or a buffer of another
        dtype, too small, not flat or not contiguous; reads only the buffers.

        Raises:
            ValueError naming the slot, the series and the sizes, and the fix.
        """
        if len(buffers) != self.buffers:
            raise ValueError(
                f"{where}: a ring of {len(buffers)} buffers; expected {self.buffers} = (k + 1 = {self.slots}) x "
                f"{len(self.groups)} per slot (one per source and dtype of the series "
                f"{[leaf for g in self.groups for leaf in g.leaves]}); make it with new_state() or Ring.new"
            )
        for i, t in enumerate(buffers):
            g = self.groups[i % len(self.groups)]
            if t.dtype != g.dtype or t.dim() != 1 or t.numel() < g.size or not t.is_contiguous():
                raise ValueError(
                    f"{where}: ring slot {i // len(self.groups)} buffer for series {list(g.leaves)} is "
                    f"{tuple(t.shape)} {t.dtype}; one layer needs a contiguous flat buffer of {g.size} {g.dtype}"
                )

    def unpack(self, flats: list[torch.Tensor]) -> dict[str, Any]:
        """One layer's weights from its slot's buffers (one per group): the per-leaf views, a quantized leaf's as
        the dict of its tensors."""
        out = {}
        for g, flat in zip(self.groups, flats):
            parts = flat.split([math.prod(s) for s in g.shapes]) if len(g.leaves) > 1 else [flat]
            out |= {leaf: part.view(shape) for leaf, part, shape in zip(g.leaves, parts, g.shapes)}
        return tree_from_paths(out)


def _ringed(params: Any) -> dict[str, tuple[str, torch.Tensor]]:
    """Every series the ring carries by dotted path: its source and its stacked tensor."""
    out = {leaf: ("peer", x) for leaf, x in flatten_with_paths(series_of(params))}
    return out | {leaf: ("host", x) for leaf, x in flatten_with_paths(host_of(params))}


def coalesced(params: Any) -> list[tuple[str, ...]]:
    """The ring's leaves grouped as its buffers are (one group per source and dtype, layer-sharded series first)."""
    groups: dict[tuple[str, torch.dtype], list[str]] = {}
    for leaf, (source, stacked) in _ringed(params).items():
        groups.setdefault((source, stacked.dtype), []).append(leaf)
    return [tuple(g) for g in groups.values()]


def ring_used(params: Any, mesh: Mesh, plan: Plan) -> bool:
    """Whether layers arrive through the ring within a step: series kept in host memory, or layer-sharded series
    over an axis of more than one rank (``plan``: the plan the params were loaded for)."""
    if host_of(params):
        return True
    return bool(series_of(params)) and plan.layer_shard is not None and mesh.axis_size(plan.layer_shard.axis) > 1


def ring_of(params: Any, mesh: Mesh, plan: Plan, k: int | None = None) -> Ring | None:
    """The ring of placed ``params`` (in the forms the graphs read) on ``mesh`` under ``plan``, at prefetch step
    ``k`` (default: the plan's, which must then be resolved to an int); None when no layer arrives through a ring
    (no series, or layer-sharded ones over an axis of size 1, and none in host memory).

    Raises:
        ValueError: ``k`` is not resolved (``prefetch_step="auto"``: ``compile_model`` resolves it).
    """
    if not ring_used(params, mesh, plan):
        return None
    k = plan.prefetch_step if k is None else k
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(
            f"ring_of: the prefetch step must be resolved to an int >= 0, got {k!r}; compile_model resolves "
            f"prefetch_step='auto' (CompiledModel.ring), or pass k"
        )
    series = _ringed(params)
    groups = tuple(
        RingGroup(
            series[leaves[0]][0],
            series[leaves[0]][1].dtype,
            leaves,
            tuple(tuple(series[leaf][1].shape[1:]) for leaf in leaves),
        )
        for leaves in coalesced(params)
    )
    axis = plan.layer_shard.axis if plan.layer_shard is not None else None
    return Ring(k, len(params["layers"]), axis, groups)
