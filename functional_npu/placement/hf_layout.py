"""How a param leaf maps to the tensors of a HF checkpoint (shared by loading and saving).

A leaf is stored as one or more *parts*: a plain leaf is one part, a leaf stacked over experts is
one part per expert, a derived leaf (an MoE expert map) is none. A part whose layout fuses blocks
(``[q|k|v]``, ``[gate|up]``) is stored as one HF tensor per block, side by side along its fused dim.
A leaf transformers holds in memory as one tensor (its fused experts) may instead be stored whole
under that name (:func:`module_name`). A quantized linear leaf is a dict of stored tensors
(:mod:`functional_npu.core.quant`), each stored as the float weight would be, under its own name:
``q_proj.weight`` becomes ``q_proj.weight_packed``, ``q_proj.weight_scale`` and
``q_proj.weight_zero_point``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.layout import Layout, Shard
from ..models import Family

__all__ = [
    "StoredPart",
    "StoredTensor",
    "QUANT_NAMES",
    "family_leaf",
    "hf_sources",
    "module_name",
    "stored_parts",
    "stored_tensors",
    "block_ranges",
    "fused_dim",
]

# the stored tensors of a quantized linear (compressed-tensors' names), keys of its leaf's dict
QUANT_NAMES = ("weight", "weight_packed", "weight_scale", "weight_zero_point")


def family_leaf(path: str) -> tuple[str, str | None]:
    """``(the family's leaf name, the stored tensor of a quantized leaf or None)`` of a param path:
    ``layers.0.qkv`` -> ``("qkv", None)``, ``layers.0.qkv.weight_scale`` -> ``("qkv", "weight_scale")``."""
    *parents, last = path.split(".")
    if last in QUANT_NAMES and parents:
        return parents[-1], last
    return last, None


@dataclass(frozen=True, slots=True)
class StoredPart:
    """One stored part of a leaf: ``index`` along dim 0 (an expert) or None, its layout, shape and HF names."""

    path: str
    index: int | None
    layout: Layout
    shape: tuple[int, ...]
    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One HF tensor: the leaf it belongs to, its expert ``index`` or None, its full shape, the layout of its
    block of the leaf (a fused leaf's block on its own: its pieces are the leaf's, block by block), and which
    block of its part it is."""

    path: str
    index: int | None
    shape: tuple[int, ...]
    layout: Layout
    block: int = 0


def hf_sources(family: Family, cfg: Any, path: str, j: int | None = None) -> list[str]:
    """The HF tensor names of the leaf at ``path`` (of expert ``j`` for a stacked leaf), in block order."""
    parents = path.split(".")
    layer = parents[1] if parents[:1] == ["layers"] else None
    leaf, sub = family_leaf(path)
    names = [name.format(i=layer, j=j) for name in family.hf_names(cfg)[leaf]]
    return names if sub is None else [name.removesuffix(".weight") + "." + sub for name in names]


def module_name(family: Family, cfg: Any, path: str, present: Collection[str]) -> str | None:
    """The name a transformers model's ``state_dict()`` holds the whole leaf at ``path`` under, if ``present``
    holds it (transformers' fused experts, ``mlp.experts.gate_up_proj``; the family's ``module_names``)."""
    leaf, sub = family_leaf(path)
    template = family.module_names(cfg).get(leaf)
    if template is None or sub is not None or not present:
        return None
    name = template.format(i=path.split(".")[1])
    return name if name in present else None


def stored_parts(
    family: Family, cfg: Any, path: str, shape: tuple[int, ...], layout: Layout, present: Collection[str] = ()
) -> list[StoredPart]:
    """The stored parts of one leaf of full ``shape`` (see the module docstring).

    A plain leaf is one part; a leaf stacked over experts has one part per expert ``j`` (its dims
    past 0); a derived leaf has none. A leaf whose transformers module name is in ``present`` is one
    part of that name, whole (stacked experts in memory, and as FSDP2 users save them with DCP).
    """
    leaf, _ = family_leaf(path)
    if leaf in (family.derived or {}):
        return []
    whole = module_name(family, cfg, path, present)
    if whole is not None:
        return [StoredPart(path, None, layout, shape, (whole,))]
    if leaf not in family.stacked:
        return [StoredPart(path, None, layout, shape, tuple(hf_sources(family, cfg, path)))]
    sub = Layout(layout.dims[1:])
    return [StoredPart(path, j, sub, shape[1:], tuple(hf_sources(family, cfg, path, j))) for j in range(shape[0])]


def block_ranges(layout: Layout, dim: int, full: int, n_sources: int, *, path: str = "<leaf>") -> list[tuple[int, int]]:
    """``(offset, size)`` along ``dim`` (of length ``full``) of each of the ``n_sources`` HF tensors of a part.

    Raises:
        ValueError if the layout fuses a different number of blocks than there are HF tensors.
    """
    spec = layout.dims[dim] if dim < len(layout.dims) else None
    if n_sources == 1:
        return [(0, full)]
    if not (
        isinstance(spec, Shard) and spec.blocks
    ):  # a fused dim kept whole (experts' [gate|up] without tp): equal blocks
        return [(i * (full // n_sources), full // n_sources) for i in range(n_sources)]
    if len(spec.blocks) != n_sources:
        raise ValueError(
            f"specs[{path!r}] dim {dim} is fused from {len(spec.blocks)} blocks {list(spec.blocks)} but the leaf "
            f"is stored as {n_sources} HF tensors; the family's param_specs and hf_names must list the same blocks"
        )
    out, offset = [], 0
    for b in spec.blocks:
        out.append((offset, b.size // spec.stored_unit))
        offset += b.size // spec.stored_unit
    return out


def fused_dim(layout: Layout) -> int:
    """The dim along which a part's HF tensors sit side by side: the first fused (blocked) dim, else 0."""
    return next((d for d, s in enumerate(layout.dims) if isinstance(s, Shard) and s.blocks), 0)


def stored_tensors(
    family: Family,
    cfg: Any,
    leaves: Mapping[str, Any],
    layouts: Mapping[str, Layout],
    present: Collection[str] = (),
) -> dict[str, StoredTensor]:
    """HF name -> :class:`StoredTensor`, for every stored tensor of the leaves (``{path: tensor of its full
    shape}``, e.g. on the meta device) under their ``layouts``; ``present``: the names a checkpoint or state
    holds (see :func:`stored_parts`)."""
    out = {}
    for path, m in leaves.items():
        for part in stored_parts(family, cfg, path, tuple(m.shape), layouts[path], present):
            d = fused_dim(part.layout)
            ranges = block_ranges(part.layout, d, part.shape[d], len(part.names), path=path)
            for k, (name, (_, size)) in enumerate(zip(part.names, ranges)):
                shape = list(part.shape)
                shape[d] = size
                layout = part.layout if len(part.names) == 1 else _block(part.layout, d, k)
                out[name] = StoredTensor(path, part.index, tuple(shape), layout, k)
    return out


def _block(layout: Layout, d: int, k: int) -> Layout:
    spec = layout.dims[d] if d < len(layout.dims) else None
    if not isinstance(spec, Shard) or not spec.blocks:
        return layout
    return layout.with_dim(d, Shard(spec.axes, (spec.blocks[k],), spec.pack, spec.groups, spec.group_size))
