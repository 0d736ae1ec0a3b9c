"""Whether a plan fits a model config and a mesh: its fields checked against the model (:func:`check_plan_fits`),
then every leaf's layout at every coordinate (:func:`check_leaves`), no I/O; and the leaf table.

:func:`functional_npu.placement.place` runs them once per model, mesh, plan and quantization.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from ..core.layout import Layout, LayoutError, dim_pieces, validate
from ..core.mesh import Mesh
from ..core.shard import local_shape
from ..core.tree import flatten_with_paths
from ..models import family_of, resolve_series, series_leaves
from ..parallel.module_tp import check_module_tp
from ..parallel.offload import check_sources
from ..parallel.plan import EXPERT_FIELDS, Plan
from ..parallel.prefetch import check_prefetch_step

__all__ = ["check_plan_fits", "check_leaves", "leaf_table", "resolved"]

_COMMON = ("tp", "module_tp", "layer_shard", "prefetch_step", "prefetch_budget", "offload", "invariant", "model")


def check_plan_fits(cfg: Any, mesh: Mesh, plan: Plan, *, where: str = "model", layers: Any = None) -> None:
    """Raise a ValueError (one line: the field, the sizes, a fix) if ``plan`` is not for this model or mesh:
    another architecture, a field this family does not read, an axis the mesh lacks, module TP the model
    cannot run, a layer-sharded series the model does not have, or a prefetch step past its layers."""
    if not isinstance(plan, Plan):
        raise TypeError(f"{where}: plan must be a functional_npu.Plan, got {type(plan).__name__}")
    family = family_of(cfg)
    if plan.model is not None and plan.model != cfg.architecture:
        raise ValueError(
            f"{where}: the plan was made for {plan.model}, but this model is a {cfg.architecture}; "
            f"make a plan for this model (or set plan.model=None)"
        )
    default = Plan()
    for name in sorted(set(plan.changed()) - set(_COMMON) - family.plan_fields):
        what = "a mixture-of-experts model" if name in EXPERT_FIELDS else "multi-head latent attention"
        raise ValueError(
            f"{where}: plan.{name}={getattr(plan, name)!r} needs {what}, but this is a {cfg.architecture}; "
            f"drop it (the default is {getattr(default, name)!r})"
        )
    if plan.tp not in mesh.axis_names:
        raise ValueError(
            f"{where}: the mesh {mesh.shape} has no {plan.tp!r} axis; add one (size 1 for no tensor parallelism)"
        )
    ls = plan.layer_shard
    if ls is not None and ls.axis not in mesh.axis_names:
        raise ValueError(
            f"{where}: layer_shard axis {ls.axis!r} is not an axis of the mesh {mesh.shape}; "
            f"use one of {list(mesh.axis_names)}"
        )
    missing = [a for a in plan.expert_axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"{where}: plan.expert_axes names axis {missing[0]!r}, but the mesh {mesh.shape} has no such axis; "
            f"use some of {list(mesh.axis_names)}"
        )
    if "num_slots" in family.plan_fields:
        _check_slots(cfg, plan, where)
    _check_module_tp(cfg, mesh, plan, where)
    _check_series(cfg, plan, where, layers)


def check_leaves(cfg: Any, mesh: Mesh, meta: Any, layouts: Mapping[str, Layout], *, where: str) -> None:
    """Every leaf's layout valid for its shape, and its pieces placed at every coordinate of ``mesh``."""
    for p, m in flatten_with_paths(meta):
        try:
            _check_leaf(p, layouts[p], tuple(m.shape), m.dtype, mesh)
        except ValueError as e:
            raise ValueError(
                f"{where}: the mesh {mesh.shape} cannot shard this {cfg.architecture} config: {e}"
            ) from None


def leaf_table(cfg: Any, mesh: Mesh, plan: Plan, meta: Any, layouts: Mapping[str, Layout]) -> str:
    """:func:`plan_table`'s text for checked ``meta`` and ``layouts``."""
    entries: dict[tuple, tuple[tuple[str, str, int], list[int]]] = {}  # (path) or (leaf, row) -> (row, layers)
    total = [0] * mesh.size
    for path, m in flatten_with_paths(meta):
        held = [
            math.prod(local_shape(m.shape, layouts[path], mesh.at(r), path=path)) * m.element_size()
            for r in range(mesh.size)
        ]
        total = [t + h for t, h in zip(total, held)]
        row = (str(tuple(m.shape)), repr(layouts[path]), max(held))
        layer = re.fullmatch(r"layers\.(\d+)\.(.+)", path)
        key = (layer.group(2), row) if layer else (path,)
        entries.setdefault(key, (row, []))[1].extend([int(layer.group(1))] if layer else [])
    rows = {}
    for key, (row, layers) in entries.items():
        which = "*" if len(layers) == cfg.num_layers else ",".join(map(str, layers))
        rows[f"layers.{which}.{key[0]}" if layers else key[0]] = row
    head = ("leaf", "shape", "layout", "bytes / rank")
    table = [head] + [(k, shape, lay, f"{b:,}") for k, (shape, lay, b) in rows.items()]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    fields = ", ".join(f"{k}={v!r}" for k, v in plan.changed().items()) or "the default plan"
    return "\n".join(
        [f"{cfg.architecture} on mesh {mesh.shape}: {fields}", *lines, f"total bytes per rank: {max(total):,} (most)"]
    )


def _check_slots(cfg: Any, plan: Plan, where: str) -> None:
    """Every expert has a slot, and no slot is left without an expert to copy: at most ``max_copies`` of each."""
    slots, experts, copies = plan.slots(cfg.num_experts), cfg.num_experts, plan.max_copies
    if slots < experts:
        raise ValueError(
            f"{where}: plan.num_slots={plan.num_slots} is fewer than the model's {experts} experts; "
            f"every expert needs a slot: use num_slots >= {experts}"
        )
    if slots > experts * copies:
        raise ValueError(
            f"{where}: plan.num_slots={plan.num_slots} is more than the model's {experts} experts x max_copies "
            f"{copies} = {experts * copies}: some slot would hold no expert; use num_slots <= {experts * copies} "
            f"or raise max_copies"
        )


def _check_module_tp(cfg: Any, mesh: Mesh, plan: Plan, where: str) -> None:
    """The module-TP plan's axes fit the mesh, and what this config cannot serve is refused."""
    mtp = plan.module_tp
    check_module_tp(mtp, mesh, tp_axis=plan.tp, taken=plan.expert_axes, where=where)
    if cfg.tie_word_embeddings and mtp.lm_head != mtp.embed:
        raise ValueError(
            f"{where}: lm_head TP over {mtp.lm_head} with tied embeddings: the head multiplies the embedding "
            f"table, which is cut over embed TP's axes {mtp.embed}; give both the same size"
        )
    if mtp.mlp and all(i in getattr(cfg, "moe_layers", ()) for i in range(cfg.num_layers)):
        raise ValueError(
            f"{where}: mlp TP over {mtp.mlp}, but every layer of this {cfg.architecture} is an MoE layer "
            f"(no dense MLP to split); drop mlp TP (experts are split with expert parallelism)"
        )


def _check_series(cfg: Any, plan: Plan, where: str, layers: Any) -> None:
    """The layer-sharded and offloaded series are this model's (:func:`functional_npu.models.series_leaves`), each
    from one source, and a numeric prefetch step fits its layers."""
    if plan.layer_shard is None and not plan.offload:
        return
    try:
        sharded = series_leaves(cfg, plan.layer_shard, plan, layers).leaves if plan.layer_shard is not None else ()
        check_sources(sharded, _offloaded(cfg, plan, layers))
        if plan.prefetch_step != "auto":
            check_prefetch_step(plan.prefetch_step, cfg.num_layers)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _offloaded(cfg: Any, plan: Plan, layers: Any) -> tuple[str, ...]:
    """``plan.offload`` resolved to leaf names, as :func:`functional_npu.models.series_leaves` resolves series."""
    return resolve_series(cfg, plan.offload, plan, layers, field="offload") if plan.offload else ()


def resolved(cfg: Any, plan: Plan, layers: Any = None) -> Plan:
    """``plan`` with its layer-sharded and offloaded series resolved for ``cfg`` (leaf names, in the family's order),
    the form loaded params carry; checked by :func:`check_plan_fits` first."""
    if not isinstance(plan, Plan):
        raise TypeError(f"resolved: plan must be a functional_npu.Plan, got {type(plan).__name__}")
    if plan.layer_shard is not None:
        plan = dataclasses.replace(plan, layer_shard=series_leaves(cfg, plan.layer_shard, plan, layers))
    if plan.offload:
        plan = dataclasses.replace(plan, offload=_offloaded(cfg, plan, layers))
    return plan


def _check_leaf(path: str, layout: Layout, shape: tuple[int, ...], dtype: torch.dtype, mesh: Mesh) -> None:
    """Validate one leaf's layout and place its pieces at every coordinate of every sharded dim."""
    validate(path, layout, shape, dtype, mesh.shape)
    for d, s in enumerate(layout.dims):
        if s is not None:
            order = tuple([a for a in mesh.axis_names if a in s.axes])
            if order != s.axes:  # a model's collectives run over its layouts' axes, in mesh order
                raise LayoutError(
                    f"specs[{path!r}] dim {d} shards over axes {s.axes}, which must be in mesh order: write {order}"
                )
            n = mesh.axis_size(s.axes)
            for c in range(n):
                dim_pieces(s, shape[d], n, c, f"specs[{path!r}]", d)
