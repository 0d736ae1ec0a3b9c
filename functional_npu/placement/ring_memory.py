"""Whether layer sharding saves memory: the bytes a rank holds of the layer-sharded series (its owned layers plus
the prefetch ring's ``k + 1`` slots of one layer) against the bytes the same series take replicated.

A rank of an axis of ``n`` holds about ``L / n`` layers of the series and, while the compiled model runs, a ring
of ``k + 1`` slots of one layer each (:mod:`functional_npu.parallel.prefetch`); over an axis of one rank there is
no ring and every layer is local. That can reach or pass replication (4 layers over 2 ranks with ``k = 1``: 2
owned + 2 slots = 4 layers). :func:`ring_memory` counts it for every rank from the placement's layouts and, when
it does not save, finds the smallest change that does by counting the changed placement (stacked and checked as
:func:`~functional_npu.placement.place` would, none built): more ranks on the axis, then a smaller ``k``, then
another series. :func:`warn_ring_memory` turns a placement that does not
save into one :class:`RingMemoryWarning` line (``load_checkpoint`` when the plan's ``k`` is an int, else
``compile_model`` where ``"auto"`` becomes one).

Example:
    >>> ring_memory(place(cfg, {"dp": 2, "tp": 1}, Plan(layer_shard="layer", prefetch_step=1)))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch

from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.shard import leaf_specs, local_shape
from ..core.tree import flatten_with_paths, tree_from_paths
from ..models import family_of
from ..parallel.layer_shard import LayerShard, series_specs, stack_series
from ..parallel.prefetch_cost import check_budget
from .check import check_leaves, check_plan_fits
from .placement import Placement

__all__ = ["RingMemory", "RingMemoryWarning", "check_ring_budget", "one_layer_bytes", "ring_memory", "warn_ring_memory"]


class RingMemoryWarning(UserWarning):
    """A layer-sharded plan whose owned layers plus prefetch ring hold at least what replication holds, or series
    kept in host memory whose ring holds every layer of them."""


@dataclass(frozen=True)
class RingMemory:
    """The layer-sharded series' bytes on the rank where they cost the most against replication.

    Attributes:
        series: the series (the plan's resolved leaves); ``axis``, ``ranks``: the mesh axis and its size.
        step: the prefetch step ``k`` counted (a ring of ``k + 1`` slots; none over an axis of one rank).
        rank: the worst rank (the highest share of replication; the lowest such rank).
        layers: the layers that rank owns; ``owned``: their bytes; ``ring``: the ring's bytes on it.
        replicated: the bytes the same series take on that rank replicated (every layer, its own shard of each).
        change: when it does not save, the smallest change that does (or a sentence saying none does).
    """

    series: tuple[str, ...]
    axis: str
    ranks: int
    step: int
    rank: int
    layers: int
    owned: int
    ring: int
    replicated: int
    change: str | None = None

    @property
    def held(self) -> int:
        return self.owned + self.ring

    @property
    def saves(self) -> bool:
        return self.held < self.replicated

    @property
    def share(self) -> float:
        """``held / replicated``."""
        return self.held / self.replicated if self.replicated else 0.0

    def message(self, where: str) -> str:
        """One line: the series, the axis, both figures with the share, the rank, and the change that saves."""
        ring = f"a prefetch ring of {self.step + 1} slots, {self.ring} bytes" if self.ring else "no ring"
        verdict = f"saves {self.replicated - self.held} bytes" if self.saves else "saves no memory"
        return (
            f"{where}: layer_shard {','.join(self.series)} over mesh axis {self.axis!r} of size {self.ranks} with "
            f"prefetch_step {self.step} {verdict}: rank {self.rank} holds {self.held} bytes of the series "
            f"({self.layers} owned layer{'s' * (self.layers != 1)}, {self.owned} bytes, and {ring}) against "
            f"{self.replicated} bytes replicated ({self.share:.0%})" + (f"; {self.change}" if self.change else "")
        )


def ring_memory(placed: Placement, step: int | None = None) -> RingMemory | None:
    """The bytes the layer-sharded series of ``placed`` cost on its worst rank (owned layers plus the ring of
    ``k + 1`` slots) against the same series replicated, in the placement's stored dtypes; with the smallest
    change that saves when it does not. ``None`` for a plan with no layer sharding.

    Args:
        placed: a placement (:func:`functional_npu.placement.place`) whose plan has ``layer_shard``.
        step: the prefetch step to count (default: the plan's ``prefetch_step``, which must then be an int).

    Raises:
        ValueError: the plan's ``prefetch_step`` is ``"auto"`` (``compile_model`` resolves it: pass ``step``), or
            ``step`` is not an int in ``[0, num_layers - 1]`` (as :func:`~functional_npu.placement.place` bounds it).
        TypeError: ``placed`` is not a placement.
    """
    if not isinstance(placed, Placement):
        raise TypeError(
            f"ring_memory: placed must be a Placement (functional_npu.placement.place(cfg, mesh, plan)), got "
            f"{type(placed).__name__}"
        )
    ls = placed.plan.layer_shard
    if ls is None:
        return None
    k = placed.plan.prefetch_step if step is None else step
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(
            f"ring_memory: series {','.join(ls.leaves)} over mesh axis {ls.axis!r} have prefetch_step {k!r}; the "
            f"ring's size needs an int k >= 0 ('auto' is resolved by compile_model: pass step=k, e.g. "
            f"model.plan.prefetch_step)"
        )
    top = max(0, placed.config.num_layers - 1)
    if k > top:  # as place() bounds plan.prefetch_step: a ring of k + 1 slots holds at most every layer
        raise ValueError(
            f"ring_memory: step {k} is past the model's {placed.config.num_layers} layers: a ring of k + 1 slots "
            f"holds at most all of them, so k <= num_layers - 1 = {top} (place() refuses the same prefetch_step); "
            f"give 0 <= step <= {top}"
        )
    found = _count(placed, k, ls, placed.mesh_shape)
    return found if found.saves else dataclasses.replace(found, change=_smallest_change(placed, k))


def _count(placed: Placement, k: int, ls: LayerShard, axes: dict[str, int]) -> RingMemory:
    """Every rank's bytes of series ``ls`` over ``axes``, from the layouts (stacked and per-layer) at its
    coordinate; the worst rank's."""
    mesh = Mesh.abstract(axes)
    stacked, layouts = _stacked(placed, ls)
    stored_meta, stored_layouts = placed.stored
    per_layer = {p: m for p, m in flatten_with_paths(stored_meta) if _series_path(p, ls)}
    n = mesh.axis_size(ls.axis)
    slots = k + 1 if n > 1 else 0  # over one rank every layer is local: no ring
    rows = []
    for r in range(mesh.size):
        at = mesh.at(r)
        shapes = {p: local_shape(m.shape, layouts[p], at, path=p) for p, m in stacked.items()}
        owned = sum(math.prod(s) * stacked[p].element_size() for p, s in shapes.items())
        slot = sum(math.prod(s[1:]) * stacked[p].element_size() for p, s in shapes.items())
        replicated = sum(
            math.prod(local_shape(m.shape, stored_layouts[p], at, path=p)) * m.element_size()
            for p, m in per_layer.items()
        )
        layers = next(iter(shapes.values()))[0] if shapes else 0
        rows.append(RingMemory(ls.leaves, ls.axis, n, k, r, layers, owned, slots * slot, replicated))
    return max(rows, key=lambda row: row.share)


def _series_path(path: str, ls: LayerShard) -> bool:
    """Whether ``path`` is a per-layer leaf (or one of its stored tensors) of series ``ls``: ``layers.<l>.<leaf>``."""
    parts = path.split(".")
    return len(parts) > 2 and parts[0] == "layers" and parts[2] in ls.leaves


def _stacked(placed: Placement, ls: LayerShard) -> tuple[dict[str, torch.Tensor], dict[str, Layout]]:
    """The stacked series' meta leaves and layouts by path (``series.<leaf>``) under ``ls``: the placement's own,
    else stacked from its stored per-layer form as placing ``ls`` does (no placement is built or cached).

    Raises:
        ValueError (from :func:`~functional_npu.parallel.layer_shard.series_specs`) for a series ``ls`` cannot take.
    """
    if ls == placed.plan.layer_shard:
        meta = {p: m for p, m in placed.meta_leaves.items() if p.split(".")[0] == "series"}
        return meta, {p: placed.layouts[p] for p in meta}
    stored_meta, stored_layouts = placed.stored
    by_layer = tree_from_paths({p: lay for p, lay in stored_layouts.items() if _series_path(p, ls)})["layers"]
    layers = range(len(stored_meta["layers"]))
    specs = series_specs({"layers": [by_layer[str(i)] for i in layers]}, ls, len(layers))["series"]
    meta = stack_series({"layers": [{f: stored_meta["layers"][i][f] for f in ls.leaves} for i in layers]}, ls)
    series = {"series": meta["series"]}
    return dict(flatten_with_paths(series)), leaf_specs({"series": specs}, series)


def _smallest_change(placed: Placement, k: int) -> str:
    """The first change that saves, each counted under the changed plan or mesh (checked as placing it would be):
    more ranks on the axis, a smaller ``k``, another series; or a sentence saying none does."""
    ls, cfg = placed.plan.layer_shard, placed.config
    n = placed.mesh_shape[ls.axis]
    for more in range(n + 1, cfg.num_layers + 1):
        found = _checked_count(placed, k, ls, placed.mesh_shape | {ls.axis: more})
        if found is not None and found.saves:
            return f"the smallest change that saves: {more} ranks on mesh axis {ls.axis!r} ({_figures(found)})"
    found = _largest_saving_step(placed, k, ls)
    if found is not None:
        return f"the smallest change that saves: prefetch_step {found.step} ({_figures(found)})"
    for leaf in _other_series(placed):
        found = _checked_count(placed, k, LayerShard(ls.axis, (leaf,)), placed.mesh_shape)
        if found is not None and found.saves:
            return f"the smallest change that saves: layer_shard {leaf!r} ({_figures(found)})"
    return (
        f"no single change saves (more ranks on mesh axis {ls.axis!r} up to {cfg.num_layers}, a smaller "
        f"prefetch_step, another series): replicate the series (layer_shard=None) or give the model more layers"
    )


def _largest_saving_step(placed: Placement, k: int, ls: LayerShard) -> RingMemory | None:
    """The count at the largest step below ``k`` that saves, or None: every rank's ring grows with the step, so
    whether it saves is monotone in it and a bisection finds it in ``log k`` counts (``k`` decides no layout: the
    same placement)."""
    lo, hi, found = -1, k, None  # hi does not save; every step <= lo does (lo = -1: none known)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        count = _count(placed, mid, ls, placed.mesh_shape)
        lo, hi, found = (mid, hi, count) if count.saves else (lo, mid, found)
    return found


def _checked_count(placed: Placement, k: int, ls: LayerShard, axes: dict[str, int]) -> RingMemory | None:
    """:func:`_count` for series ``ls`` over ``axes`` where the changed placement is valid (the plan fits the mesh,
    every leaf shards at every coordinate); ``None`` where it is not."""
    mesh, cfg = Mesh.abstract(axes), placed.config
    plan = dataclasses.replace(placed.plan, layer_shard=ls)
    try:
        check_plan_fits(cfg, mesh, plan, where="ring_memory", layers=placed.stored[0]["layers"])
        stacked, layouts = _stacked(placed, ls)
        check_leaves(cfg, mesh, tree_from_paths(stacked), layouts, where="ring_memory")
        if ls == placed.plan.layer_shard:
            check_leaves(cfg, mesh, placed.meta, placed.layouts, where="ring_memory")
    except (TypeError, ValueError):
        return None
    return _count(placed, k, ls, axes)


def _other_series(placed: Placement) -> list[str]:
    """The family's series leaves every layer has, other than the plan's, in series order."""
    layers = placed.stored[0]["layers"]
    mine = set(placed.plan.layer_shard.leaves)
    every = [leaf for leaf in family_of(placed.config).layer_leaves if all(leaf in layer for layer in layers)]
    return [leaf for leaf in every if leaf not in mine]


def _figures(found: RingMemory) -> str:
    return f"rank {found.rank} would hold {found.held} of {found.replicated} bytes, {found.share:.0%}"


def one_layer_bytes(placed: Placement, dtype: torch.dtype | None = None) -> int:
    """The bytes of one layer of the layer-sharded series (one ring slot, every series coalesced) on the rank where it
    is largest; 0 without layer sharding. ``dtype``: the floating leaves are counted in it (the dtype they are loaded
    in), the others (quantized integers) as stored."""
    ls = placed.plan.layer_shard
    if ls is None:
        return 0
    stacked, layouts = _stacked(placed, ls)
    return _largest_slot(placed, {p: (m, layouts[p]) for p, m in stacked.items()}, dtype, stacked=True)


def one_host_layer_bytes(placed: Placement, dtype: torch.dtype | None = None) -> int:
    """The bytes of one layer of the series kept in host memory (one ring slot: each series' layer as the layer holds
    it), on the rank where it is largest; ``dtype`` as :func:`one_layer_bytes`'s."""
    stored_meta, stored_layouts = placed.stored
    layer = stored_meta["layers"][0]
    leaves = {f: (layer[f], stored_layouts[f"layers.0.{f}"]) for f in placed.plan.offload if f in layer}
    return _largest_slot(placed, leaves, dtype, stacked=False)


def _largest_slot(
    placed: Placement, leaves: dict[str, tuple[torch.Tensor, Layout]], dtype: torch.dtype | None, *, stacked: bool
) -> int:
    """The most bytes one layer of ``leaves`` (meta tensors and their layouts; ``stacked``: ``[L, ...]``, one layer
    the rest) takes on any rank of the placement's mesh, floating leaves counted in ``dtype`` (None: as stored)."""
    mesh = Mesh.abstract(placed.mesh_shape)

    def size(m: torch.Tensor) -> int:
        return torch.empty((), dtype=dtype).element_size() if dtype and m.dtype.is_floating_point else m.element_size()

    def layer_bytes(p: str, m: torch.Tensor, layout: Layout, r: int) -> int:
        local = local_shape(m.shape, layout, mesh.at(r), path=p)
        return math.prod(local[1:] if stacked else local) * size(m)

    return max(sum(layer_bytes(p, m, lay, r) for p, (m, lay) in leaves.items()) for r in range(mesh.size))


def check_ring_budget(placed: Placement, where: str, dtype: torch.dtype | None = None) -> None:
    """Refuse (before any weight is read) a plan whose ``prefetch_step="auto"`` budget cannot hold one layer of its
    series, in the words ``compile_model`` would use once the weights were loaded.

    Raises:
        ValueError: naming the budget, the series and one layer's bytes.
    """
    plan = placed.plan
    if plan.prefetch_step != "auto" or plan.prefetch_budget is None:
        return
    if plan.layer_shard is not None:
        check_budget(plan.prefetch_budget, one_layer_bytes(placed, dtype), ",".join(plan.layer_shard.leaves), where)
    elif plan.offload:  # host series alone: the ring holds one layer of them (a budget once ignored)
        check_budget(plan.prefetch_budget, one_host_layer_bytes(placed, dtype), ",".join(plan.offload), where)


def warn_ring_memory(placed: Placement, where: str, *, stacklevel: int = 2) -> RingMemory | None:
    """Warn (one :class:`RingMemoryWarning` line, :meth:`RingMemory.message`) if the layer-sharded series of
    ``placed`` hold at least what replication holds on some rank, and (another line) if the ring of the series kept
    in host memory holds every layer of them; nothing with ``prefetch_step="auto"`` (not yet resolved:
    ``compile_model`` warns once it is). Returns the layer-sharded series' count (None without layer sharding)."""
    if placed.plan.prefetch_step == "auto":
        return None
    if placed.plan.offload:
        _warn_host_ring(placed, where, stacklevel + 1)
    if placed.plan.layer_shard is None:
        return None
    found = ring_memory(placed)
    if not found.saves:
        warnings.warn(found.message(where), RingMemoryWarning, stacklevel=stacklevel + 1)
    return found


def _warn_host_ring(placed: Placement, where: str, stacklevel: int) -> None:
    """Warn when the offloaded series' ring of ``k + 1`` slots holds every layer: the device then holds all of them,
    as it would resident, plus their host copies."""
    k, L = placed.plan.prefetch_step, placed.config.num_layers
    if k + 1 < L:
        return
    fix = f"use prefetch_step {L - 2} or less" if L > 1 else "keep the series on the device (a model of one layer)"
    warnings.warn(
        f"{where}: offload {','.join(placed.plan.offload)} with prefetch_step {k} over {L} layers keeps a ring of "
        f"{k + 1} slots on the device, every layer of the series: keeping them in host memory saves no device "
        f"memory; {fix}",
        RingMemoryWarning,
        stacklevel=stacklevel + 1,
    )
