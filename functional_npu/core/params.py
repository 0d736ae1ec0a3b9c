"""A model's params as one typed value: the tree of tensors, and beside it, as static metadata, what the checkpoint
holds (the model config) and where each piece lives (the placement), as a JAX array carries its sharding.

:class:`Params` reads like the tree it holds (``params["layers"][3]["qkv"]``, ``"series" in params``,
``params.get("host")``) and is registered as a pytree node whose children are the tree's entries and whose context is
the config and the placement: a tree map (``shard``, ``map_with_path``, ``torch.func.grad``, a dtype cast) returns
``Params`` of the same config and placement, and a leaf's path is the tree's (``layers.3.qkv``), never a field's.
Nothing static is a key of the tree: ``params.config`` and ``params.placement`` are fields, held once (a placed
value's config is its placement's).

The placement is the placement layer's :class:`~functional_npu.placement.Placement` (checked against the model,
the mesh's axes and the quantization); this module only carries it. ``None``: a full tree, or shards no plan was
checked for (``shard`` of a family's full params by its default layouts).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch.utils._pytree as pytree

__all__ = ["Params", "drop"]

_FIELDS = ("config", "placement")


class Params:
    """``tree`` (a dict of tensors and nested dicts / lists of them), ``config`` and ``placement`` (static).

    Raises:
        TypeError: a tree that is not a dict, or that holds a static field under a string key.
        ValueError: a placement made for another config.
    """

    __slots__ = ("tree", "config", "placement")

    def __init__(self, tree: Mapping[str, Any], config: Any = None, placement: Any = None) -> None:
        if isinstance(tree, Params):
            raise TypeError("Params(tree=...): tree is already a Params; use params.replace(...) or params.placed(...)")
        if not isinstance(tree, Mapping):
            raise TypeError(f"Params(tree=...): a dict of tensors, got {type(tree).__name__}")
        static = sorted(k for k in _FIELDS if k in tree)
        if static:
            raise TypeError(
                f"Params: {static} in the tree; the config and the placement are fields, not keys: "
                f"Params(tree, config=..., placement=...)"
            )
        if isinstance(config, (str, Mapping)):
            raise TypeError(
                f"Params: config must be a model config object (functional_npu.read_config(path)), got "
                f"{type(config).__name__} {config!r:.60}"
            )
        if placement is not None:
            if not (hasattr(placement, "config") and hasattr(placement, "layouts")):
                raise TypeError(
                    f"Params: placement must be a functional_npu.Placement (place(config, mesh, plan)), got "
                    f"{type(placement).__name__}"
                )
            own = placement.config
            if config is not None and config is not own and config != own:
                raise ValueError(
                    f"Params: the placement was made for {getattr(own, 'architecture', own)!r}, not for the config "
                    f"given ({getattr(config, 'architecture', config)!r}); place the params for their config"
                )
            config = own  # one config, the placement's
        object.__setattr__(self, "tree", dict(tree))
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "placement", placement)

    def __reduce__(self) -> tuple[Any, ...]:  # pickled (a saved graph's inputs) as it is made, never field by field
        return (Params, (self.tree, self.config, self.placement))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Params is immutable: params.replace(...) or params.placed(...) makes a new one ({name})")

    # ---- the tree, read as a mapping ----
    def __getitem__(self, key: str) -> Any:
        if key in _FIELDS and key not in self.tree:
            raise KeyError(f"params[{key!r}]: the {key} is a field of the params, not a key: params.{key}")
        return self.tree[key]

    def __contains__(self, key: object) -> bool:
        return key in self.tree

    def get(self, key: str, default: Any = None) -> Any:
        return self.tree.get(key, default)

    def keys(self) -> Any:
        return self.tree.keys()

    def values(self) -> Any:
        return self.tree.values()

    def items(self) -> Any:
        return self.tree.items()

    def __iter__(self) -> Iterator[str]:
        return iter(self.tree)

    def __len__(self) -> int:
        return len(self.tree)

    # ---- new values ----
    def replace(self, **entries: Any) -> Params:
        """The same config and placement over the tree with ``entries`` set (a subtree each)."""
        return Params(self.tree | entries, self.config, self.placement)

    def __or__(self, entries: Mapping[str, Any]) -> Params:
        """``params | {"layers": ...}``: :meth:`replace` (a static field is refused by name)."""
        return self.replace(**entries)

    def without(self, *keys: str) -> Params:
        """The same config and placement over the tree less ``keys``."""
        return Params({k: v for k, v in self.tree.items() if k not in keys}, self.config, self.placement)

    def placed(self, placement: Any) -> Params:
        """The same tree carrying ``placement`` (made for this config)."""
        return Params(self.tree, self.config, placement)

    def __repr__(self) -> str:
        model = getattr(self.config, "architecture", type(self.config).__name__)
        where = self.placement.describe() if hasattr(self.placement, "describe") else "unplaced"
        return f"Params({model}; {where}; {sorted(self.tree)})"


def drop(tree: Any, *keys: str) -> Any:
    """``tree`` less its entries ``keys``: a :class:`Params` keeps its config and placement, a dict is a dict."""
    if isinstance(tree, Params):
        return tree.without(*keys)
    return {k: v for k, v in tree.items() if k not in keys}


def _flatten(p: Params) -> tuple[list[Any], Any]:
    return list(p.tree.values()), (tuple(p.tree), p.config, p.placement)


def _flatten_with_keys(p: Params) -> tuple[list[tuple[Any, Any]], Any]:
    return [(pytree.MappingKey(k), v) for k, v in p.tree.items()], (tuple(p.tree), p.config, p.placement)


def _unflatten(children: Any, context: Any) -> Params:
    keys, config, placement = context
    return Params(dict(zip(keys, children)), config, placement)


pytree.register_pytree_node(
    Params,
    _flatten,
    _unflatten,
    serialized_type_name="functional_npu.Params",
    flatten_with_keys_fn=_flatten_with_keys,
)
