"""Layer-sharded weight series: layer ``l``'s weight lives only on coordinate ``l % n`` of a mesh axis.

A *series* is one per-layer leaf (``o_proj``, ``down``, ...) taken from every layer: in the params
it is a stacked leaf ``params["series"][leaf]`` of the layers this coordinate owns, in layer order
(``l = c, c + n, c + 2n, ...``), whose dim 0 has the layout ``Cyclic(axis, L)`` and whose other
dims keep the per-layer (tensor-parallel) layout. The per-layer dicts in ``params["layers"]`` no
longer hold the leaf. The choice is the plan's ``layer_shard`` (a :class:`LayerShard`, see
:class:`functional_npu.parallel.plan.Plan`), which loaded params carry in their placement
(``params.placement.plan``).

Everything here is pure: the layouts, stacking full params into series and back, the layers a
coordinate owns, and resident bytes measured from tensor storage. The forward fetches each layer's
weight from its owner with a broadcast, ``k`` layers ahead (:mod:`functional_npu.prefetch`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..core.layout import Cyclic, Layout
from ..core.params import drop
from ..core.tree import register_static

__all__ = [
    "LayerShard",
    "layer_shard",
    "series_specs",
    "stack_series",
    "unstack_series",
    "owned_layers",
    "resident_bytes",
    "series_of",
    "present",
]


@dataclass(frozen=True, slots=True)
class LayerShard:
    """Which per-layer series are layer-sharded, and over which mesh axis.

    ``leaves`` are the names asked for: a family's per-layer leaves, its aliases (``down_proj``) or ``layer``
    (every per-layer leaf every layer has). The family resolves them for a model
    (:func:`functional_npu.models.series_leaves`); the loader and the compiler work on the resolved form,
    where each name is a leaf every layer holds, in the family's order."""

    axis: str
    leaves: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or not self.axis.isidentifier():
            raise ValueError(f"LayerShard: axis must be a mesh axis name such as 'dp', got {self.axis!r}")
        names = tuple(self.leaves) if isinstance(self.leaves, list) else self.leaves
        object.__setattr__(self, "leaves", names)
        if not isinstance(names, tuple) or not names or not all(isinstance(n, str) and n.isidentifier() for n in names):
            raise ValueError(
                f"LayerShard: leaves must be a non-empty tuple of series names such as ('o_proj', 'down'), got "
                f"{names!r}; or build one from 'o_proj,down' with layer_shard(...)"
            )

    def __repr__(self) -> str:
        return f"LayerShard({self.axis!r}, {list(self.leaves)})"


register_static(LayerShard)


def layer_shard(names: str | Sequence[str], axis: str = "dp") -> LayerShard:
    """Series names (``"o_proj,down_proj"``, ``["layer"]``, ...) over ``axis`` as a :class:`LayerShard`; which
    leaves they are is the model's family's to say (:func:`functional_npu.models.series_leaves`).

    Raises:
        ValueError for no names, a name that is not an identifier, or an axis that is not a name.
    """
    parts = series_names(names, "layer_shard")
    if not isinstance(axis, str) or not axis.isidentifier():
        raise ValueError(f"layer_shard: axis must be a mesh axis name such as 'dp', got {axis!r}")
    return LayerShard(axis, parts)


def series_names(names: Any, where: str, empty: bool = False) -> tuple[str, ...]:
    """Series names from ``"o_proj,down_proj"`` or a sequence of names, deduplicated in order (blank ones dropped).

    Raises:
        ValueError starting with ``where`` for a value that is not names, a name that is not an identifier, or no
        names (unless ``empty``).
    """
    parts = names.split(",") if isinstance(names, str) else names
    if not isinstance(parts, (list, tuple)):
        parts = [parts]
    parts = [p.strip() if isinstance(p, str) else p for p in parts]
    bad = [p for p in parts if not isinstance(p, str) or (p and not p.isidentifier())]
    kept = () if bad else tuple(dict.fromkeys(p for p in parts if p))
    if bad or not (kept or empty):
        raise ValueError(
            f"{where}: expected series names like 'o_proj,down_proj' or 'layer', got {names!r}"
            + (f" ({bad[0]!r} is not a name)" if bad else "")
        )
    return kept


def present(ls: LayerShard, layers: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The series leaves of a resolved :class:`LayerShard`, each checked to be a leaf every layer has.

    Raises:
        ValueError naming a series that is not such a leaf (an alias not yet resolved by the family, or a leaf
        some layers lack), and how to resolve it.
    """
    bad = [leaf for leaf in ls.leaves if not all(leaf in layer for layer in layers)]
    if bad:
        have = [leaf for leaf in layers[0] if all(leaf in layer for layer in layers)] if layers else []
        raise ValueError(
            f"layer_shard: {bad} are not leaves every layer has ({have}); resolve series names for a model with "
            f"functional_npu.models.series_leaves(cfg, layer_shard)"
        )
    return ls.leaves


def series_of(params: dict[str, Any]) -> dict[str, Any]:
    """The layer-sharded series of a params tree, ``{leaf: stacked owned layers}`` (empty when none); a
    quantized leaf's is the dict of its stacked tensors."""
    return params.get("series") or {}


def series_specs(specs: dict[str, Any], ls: LayerShard, num_layers: int) -> dict[str, Any]:
    """A family's spec tree with the series moved to stacked, cyclic leaves under ``specs["series"]``.

    The per-layer spec must be given per leaf (a dict), as every family's ``param_specs`` does; a
    quantized leaf's spec is the dict of its stored tensors' layouts, each stacked alike.
    """
    layer = specs["layers"][0]
    leaves = present(ls, specs["layers"])
    for leaf in leaves:
        if any(ls.axis in lay.axes() for lay in pytree.tree_leaves(layer[leaf])):
            raise ValueError(
                f"layer_shard: series {leaf!r} is already sharded over mesh axis {ls.axis!r}; "
                f"layer-shard it over an axis it is replicated on (dp)"
            )

    def stacked(lay: Layout) -> Layout:
        return Layout((Cyclic(ls.axis, num_layers),) + lay.dims)

    series = {leaf: pytree.tree_map(stacked, layer[leaf]) for leaf in leaves}
    rest = [{k: v for k, v in spec.items() if k not in leaves} for spec in specs["layers"]]
    return specs | {"layers": rest, "series": series}


def stack_series(params: dict[str, Any], ls: LayerShard) -> dict[str, Any]:
    """Full params (a list of per-layer dicts) -> params with the series stacked ``[L, ...]``. Pure."""
    layers = params["layers"]
    leaves = present(ls, layers)
    series = {leaf: pytree.tree_map(lambda *xs: torch.stack(xs), *[layer[leaf] for layer in layers]) for leaf in leaves}
    rest = [{k: v for k, v in layer.items() if k not in leaves} for layer in layers]
    return params | {"layers": rest, "series": series}


def unstack_series(params: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`stack_series` for full (gathered) params. Pure."""
    if "series" not in params:
        return params
    series = params["series"]
    layers = [
        layer | {leaf: pytree.tree_map(lambda x, i=i: x[i].clone(), series[leaf]) for leaf in series}
        for i, layer in enumerate(params["layers"])
    ]
    return drop(params, "series") | {"layers": layers}


def owned_layers(num_layers: int, n: int, c: int) -> list[int]:
    """Layers held by coordinate ``c`` of an axis of size ``n``: ``c, c + n, ...`` (l % n == c)."""
    counts = {"num_layers": (num_layers, 0), "n": (n, 1), "c": (c, 0)}
    for name, (value, low) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"owned_layers: {name} must be an int >= {low}, got {value!r}")
    if c >= n:
        raise ValueError(f"owned_layers: coordinate c={c} is outside an axis of size n={n}; give 0 <= c < {n}")
    return list(range(c, num_layers, n))


def resident_bytes(tensors: Any) -> int:
    """Bytes of distinct storage behind every tensor in a pytree (views of one storage count once).

    An in-flight collective's result is waited on first, so its real buffer is counted.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if tensors is None or isinstance(tensors, (str, bytes, int, float)):
        raise TypeError(
            f"resident_bytes: expected a tensor or a pytree of them (params, a ring's slots), got "
            f"{type(tensors).__name__} {tensors!r:.60}"
        )
    seen: dict[int, int] = {}
    for x in pytree.tree_leaves(tensors):
        if isinstance(x, AsyncCollectiveTensor):
            x = x.wait()
        if isinstance(x, torch.Tensor) and x.numel():
            s = x.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def series_bound(num_layers: int, n: int, k: int) -> float:
    """The resident fraction of a replicated series a rank may hold: ``(ceil(L / n) + k + 1) / L``."""
    return (math.ceil(num_layers / n) + k + 1) / num_layers
