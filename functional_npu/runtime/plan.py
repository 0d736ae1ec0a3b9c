"""Whether a mesh can shard a model config: every leaf's layout checked at every coordinate (no I/O).

The loader, the compiler and the CLI's ``--check`` all ask this before touching a tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..core.layout import Layout, LayoutError, dim_pieces, validate
from ..core.mesh import Mesh
from ..core.shard import leaf_specs
from ..core.tree import flatten_with_paths
from ..models import family_of
from ..parallel.layer_shard import LayerShard, series_specs, stack_series
from ..parallel.module_tp import check_module_tp
from .quant_config import QuantConfig
from .quant_plan import quantize_plan

__all__ = ["check_plan", "with_expert_axes"]


def with_expert_axes(cfg: Any, expert_axes: Sequence[str], *, where: str = "model") -> Any:
    """``cfg`` with its experts sharded over ``expert_axes`` (MoE configs; ``()`` leaves any config as it is)."""
    if not expert_axes:
        return cfg
    if "expert_axes" not in {f.name for f in dataclasses.fields(cfg)}:
        raise ValueError(
            f"{where}: expert_axes={tuple(expert_axes)} needs a mixture-of-experts model, "
            f"but this is a {cfg.architecture}; drop expert_axes (--ep)"
        )
    return dataclasses.replace(cfg, expert_axes=tuple(expert_axes))


def check_plan(
    cfg: Any,
    mesh: Mesh,
    *,
    where: str = "model",
    layer_shard: LayerShard | None = None,
    tp_axis: str = "tp",
    quant: QuantConfig | None = None,
) -> tuple[dict[str, Any], dict[str, Layout]]:
    """Raise a ValueError if ``mesh`` cannot shard ``cfg`` at any of its coordinates (no I/O).

    Args:
        cfg: a model config (from ``read_config``, with its expert axes if any).
        mesh: the mesh; its coordinate is ignored, every coordinate is checked.
        where: what the messages start with (the model directory, ``compile_model``).
        layer_shard: also check layer-sharding these series over ``layer_shard.axis`` (any family:
            the series are the leaves every layer has).
        tp_axis: the mesh axis of tensor parallelism (the family's ``param_specs(cfg, tp_axis=...)``).
        quant: a quantized checkpoint's scheme: the linear leaves it covers are the dicts of their
            stored tensors (:func:`functional_npu.runtime.quant_plan.quantize_plan`).

    Returns:
        The full params on the meta device and each leaf's layout, for the caller to reuse; with
        ``layer_shard``, in the layer-sharded structure (series stacked under ``params["series"]``).
    """
    if tp_axis not in mesh.axis_names:
        raise ValueError(
            f"{where}: the mesh {mesh.shape} has no {tp_axis!r} axis; add one (size 1 for no tensor parallelism)"
        )
    family = family_of(cfg)
    _check_module_tp(cfg, mesh, tp_axis, where)
    meta, specs = family.abstract_params(cfg), family.param_specs(cfg, tp_axis=tp_axis)
    if quant is not None:
        meta, specs = quantize_plan(family, cfg, quant, meta, specs, where=where)
    if layer_shard is not None:
        if layer_shard.axis not in mesh.axis_names:
            raise ValueError(
                f"{where}: layer_shard axis {layer_shard.axis!r} is not an axis "
                f"of the mesh {mesh.shape}; use one of {list(mesh.axis_names)}"
            )
        meta, specs = stack_series(meta, layer_shard), series_specs(specs, layer_shard, cfg.num_layers)
    layouts = leaf_specs(specs, meta)
    for p, m in flatten_with_paths(meta):
        try:
            _check_leaf(p, layouts[p], tuple(m.shape), m.dtype, mesh)
        except ValueError as e:
            raise ValueError(
                f"{where}: the mesh {mesh.shape} cannot shard this {cfg.architecture} config: {e}"
            ) from None
    return meta, layouts


def _check_module_tp(cfg: Any, mesh: Mesh, tp_axis: str, where: str) -> None:
    """The module-TP plan's axes fit the mesh, and what this config cannot serve is refused."""
    plan = cfg.module_tp
    check_module_tp(plan, mesh, tp_axis=tp_axis, taken=getattr(cfg, "expert_axes", ()), where=where)
    if cfg.tie_word_embeddings and plan.lm_head != plan.embed:
        raise ValueError(
            f"{where}: lm_head TP over {plan.lm_head} with tied embeddings: the head multiplies the embedding "
            f"table, which is cut over embed TP's axes {plan.embed}; give both the same size"
        )
    if plan.mlp and all(i in getattr(cfg, "moe_layers", ()) for i in range(cfg.num_layers)):
        raise ValueError(
            f"{where}: mlp TP over {plan.mlp}, but every layer of this {cfg.architecture} is an MoE layer "
            f"(no dense MLP to split); drop mlp TP (experts are split with expert parallelism)"
        )


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
