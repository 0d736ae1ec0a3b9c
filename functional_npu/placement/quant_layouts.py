"""A quantized checkpoint's params: which linear leaves it stores quantized, and their stored trees.

A compressed-tensors checkpoint quantizes the linear modules its ``targets`` match and its
``ignore`` does not (:class:`functional_npu.placement.quant_config.QuantConfig`). Here that becomes
data over the family's params: each covered linear leaf (``family.linears``) is replaced, in the
full params on the meta device and in the plan, by the dict of its stored tensors
(:func:`functional_npu.core.quant.quant_shapes`) and their layouts
(:func:`functional_npu.core.quant.quant_layouts`). The loader reads that tree like any other, the
plan check validates it (a group or packed word a shard would cut is named with its dim, sizes and
axis), and the choice rides in the params' placement (``params.placement.quant``, a :class:`QuantConfig`).

A leaf that fuses several modules (``[q|k|v]``, ``[gate|up]``, every expert of a stack) is quantized
only if the config covers all of them; a checkpoint covering some is refused, naming them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.layout import Layout, Shard, dim_pieces
from ..core.mesh import Mesh
from ..core.quant import quant_layouts, quant_shapes
from ..core.shard import leaf_specs, local_shape
from ..core.tree import flatten_with_paths, map_with_path
from ..models import Family
from .hf_layout import hf_sources
from .quant_config import QuantConfig

__all__ = ["quantized_leaves", "quantize_plan", "tensor_blocks"]


def _modules(family: Family, cfg: Any, path: str, shape: tuple[int, ...]) -> list[str]:
    """The checkpoint modules a linear leaf is stored as (every expert's, for a leaf stacked over experts)."""
    leaf = path.split(".")[-1]
    experts = range(shape[0]) if leaf in family.stacked else [None]
    return [name.removesuffix(".weight") for j in experts for name in hf_sources(family, cfg, path, j)]


def quantized_leaves(family: Family, cfg: Any, qc: QuantConfig, meta: Any, *, where: str = "model") -> set[str]:
    """The paths of the linear leaves of ``meta`` (full params, per-layer form) that ``qc`` quantizes.

    Raises:
        ValueError for a leaf whose modules the config covers only in part.
    """
    out = set()
    for path, m in flatten_with_paths(meta):
        if path.split(".")[-1] not in family.linears:
            continue
        modules = _modules(family, cfg, path, tuple(m.shape))
        covered = [mod for mod in modules if qc.applies_to(mod)]
        if covered and len(covered) < len(modules):
            rest = [mod for mod in modules if mod not in covered]
            raise ValueError(
                f"{where}: params[{path!r}] is stored as {len(modules)} modules, but quantization_config "
                f"quantizes {covered[:3]}{' ...' if len(covered) > 3 else ''} and not "
                f"{rest[:3]}{' ...' if len(rest) > 3 else ''}; a fused leaf is quantized whole or not at all: "
                f"give its modules one scheme (targets / ignore)"
            )
        if covered:
            out.add(path)
    return out


def quantize_plan(
    family: Family, cfg: Any, qc: QuantConfig, meta: Any, specs: Any, *, where: str = "model"
) -> tuple[Any, Any]:
    """``(meta, specs)`` with every quantized linear leaf replaced by its stored tensors: ``meta`` the full
    params on the meta device (per-layer form), ``specs`` their plan (any prefix tree); the result's specs
    are a full tree of layouts, one per stored tensor.

    Raises:
        ValueError naming the leaf whose shape a pack factor, group or block does not divide.
    """
    layouts = leaf_specs(specs, meta)
    chosen = quantized_leaves(family, cfg, qc, meta, where=where)
    q = qc.quant
    dtypes = {"weight": torch.int8, "weight_packed": torch.int32, "weight_zero_point": q.storage}

    def stored(path: str, m: torch.Tensor) -> Any:
        if path not in chosen:
            return m
        blocks = len(hf_sources(family, cfg, path, 0 if path.split(".")[-1] in family.stacked else None))
        try:
            shapes = quant_shapes(tuple(m.shape), q, blocks)
        except ValueError as e:
            raise ValueError(f"{where}: params[{path!r}] cannot be stored as {q!r}: {e}") from None
        return {k: torch.empty(s, dtype=dtypes.get(k, m.dtype), device="meta") for k, s in shapes.items()}

    def plan(path: str, m: torch.Tensor) -> Layout | dict[str, Layout]:
        if path not in chosen:
            return layouts[path]
        return quant_layouts(layouts[path], q, m.ndim)

    return map_with_path(stored, meta), map_with_path(plan, meta)


def tensor_blocks(path: str, weight: str, layouts: dict[str, Layout], full: dict[str, Any], mesh: Mesh) -> list[int]:
    """This coordinate's sizes along ``out`` of the matrices fused in the quantized leaf at ``path`` (one
    per-tensor scale each): ``[q, k, v]`` of its shard of ``[q|k|v]``. ``weight``: the stored values' name;
    ``layouts`` / ``full``: each stored tensor's layout and full (meta) tensor, by path."""
    key = f"{path}.{weight}"
    layout, shape = layouts[key], tuple(full[key].shape)
    out = len(shape) - 2
    spec = layout.dims[out] if out < len(layout.dims) else None
    if not isinstance(spec, Shard) or not spec.blocks:
        return [local_shape(shape, layout, mesh, path=key)[out]]
    pieces = dim_pieces(spec, shape[out], mesh.axis_size(spec.axes), mesh.axis_index(spec.axes), key, out)
    held = [i for p in pieces for i in range(*p)]
    sizes, offset = [], 0
    for b in spec.blocks:
        size = b.size // spec.stored_unit
        sizes.append(sum(offset <= i < offset + size for i in held))
        offset += size
    return sizes
