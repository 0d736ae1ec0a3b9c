"""Pytrees of tensors addressed by dotted paths (``layers.3.attn.qkv``).

Thin helpers over ``torch.utils._pytree`` (which dynamo traces natively): flatten
with paths, map with paths, build a nested tree from paths, check that two trees
have the same leaves, and expand a spec tree that is a prefix of a params tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.utils._pytree as pytree

__all__ = [
    "PyTree",
    "flatten_with_paths",
    "map_with_path",
    "tree_from_paths",
    "check_structure",
    "expand_prefix",
    "register_static",
    "replace_leaves",
]

PyTree = Any


def register_static(cls: type) -> type:
    """Register ``cls`` as a pytree node with no leaves, so tree maps carry an instance along unchanged.

    For static data that rides in a params tree (a model config, a layer-sharding choice).
    """
    pytree.register_pytree_node(
        cls,
        lambda x: ([], x),
        lambda _, x: x,
        serialized_type_name=f"functional_npu.{cls.__name__}",
        flatten_with_keys_fn=lambda x: ([], x),
    )
    return cls


def _key_str(key: Any) -> str:
    if isinstance(key, pytree.MappingKey):
        return str(key.key)
    if isinstance(key, pytree.SequenceKey):
        return str(key.idx)
    if isinstance(key, pytree.GetAttrKey):
        return key.name
    return str(key)  # pragma: no cover - custom key kinds


def path_str(keypath: Iterable[Any]) -> str:
    """The dotted form of a pytree key path (``('layers', 0, 'w')`` -> ``layers.0.w``)."""
    return ".".join(_key_str(k) for k in keypath)


def flatten_with_paths(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """Leaves of ``tree`` with their dotted paths, in pytree order.

    Example:
        >>> flatten_with_paths({"a": {"b": 1}, "c": [2, 3]})
        [('a.b', 1), ('c.0', 2), ('c.1', 3)]
    """
    leaves, _ = pytree.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_str(kp), leaf) for kp, leaf in leaves]


def map_with_path(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """``fn(path, leaf, *other_leaves)`` applied to every leaf; returns a new tree."""
    return pytree.tree_map_with_path(lambda kp, *xs: fn(path_str(kp), *xs), tree, *rest)


def replace_leaves(tree: PyTree, by_path: Mapping[str, Any]) -> PyTree:
    """``tree`` with the leaf at each path of ``by_path`` replaced by its value (the other nodes as they were)."""
    return map_with_path(lambda path, x: by_path.get(path, x), tree)


def tree_from_paths(items: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Nested dicts from ``{dotted path: leaf}``; the inverse of :func:`flatten_with_paths` for dict trees.

    Raises:
        ValueError: if a path is both a leaf and a prefix of another path.
    """
    out: dict[str, Any] = {}
    for path, leaf in items.items() if isinstance(items, Mapping) else items:
        if not isinstance(path, str):
            raise TypeError(
                f"path {path!r}: a path is a str of dotted keys such as 'layers.0.qkv', got {type(path).__name__}"
            )
        if "" in path.split("."):
            raise ValueError(f"path {path!r} has an empty key; a path is dotted keys such as 'layers.0.qkv'")
        *parents, last = path.split(".")
        node = out
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"path {path!r}: {'.'.join(parents[: i + 1])!r} is already a leaf")
        if last in node:
            raise ValueError(f"path {path!r} is given twice or is also a prefix of another path")
        node[last] = leaf
    return out


def _mismatch(title: str, groups: list[tuple[str, list[str]]], fix: str | None = None) -> ValueError:
    lines = [title] + [f"  {label} ({len(paths)}): " + ", ".join(paths) for label, paths in groups if paths]
    return ValueError("\n".join(lines + ([f"  fix: {fix}"] if fix else [])))


def check_structure(tree: PyTree, reference: PyTree, *, what: str = "params", against: str = "expected") -> None:
    """Raise a ValueError naming every missing and unexpected leaf path of ``tree`` versus ``reference``."""
    got = {p for p, _ in flatten_with_paths(tree)}
    want = {p for p, _ in flatten_with_paths(reference)}
    missing, unexpected = sorted(want - got), sorted(got - want)
    if missing or unexpected:
        raise _mismatch(
            f"{what} do not match the {against} structure:", [("missing", missing), ("unexpected", unexpected)]
        )


def _longest_prefix(path: str, prefixes: Mapping[str, Any]) -> str | None:
    """The longest of ``path``'s dotted prefixes (itself, ..., its first key, then "") in ``prefixes``."""
    parts = path.split(".") if path else []
    for n in range(len(parts), -1, -1):
        candidate = ".".join(parts[:n])
        if candidate in prefixes:
            return candidate
    return None


def expand_prefix(
    prefix_tree: PyTree, tree: PyTree, *, is_leaf: Callable[[Any], bool], what: str = "specs"
) -> dict[str, Any]:
    """Map every leaf path of ``tree`` to the leaf of ``prefix_tree`` whose path is its longest prefix.

    ``prefix_tree`` may stop above the leaves of ``tree``: a spec at ``layers`` applies to every
    leaf under ``layers``. A bare leaf (not a container) applies to the whole tree.

    Raises:
        ValueError: naming the leaves of ``tree`` that no prefix covers and the prefixes that
            cover no leaf.
    """
    prefixes = dict(flatten_with_paths(prefix_tree, is_leaf=is_leaf))
    out: dict[str, Any] = {}
    uncovered = []
    used = set()
    for path, _ in flatten_with_paths(tree):
        match = _longest_prefix(path, prefixes)
        if match is None:
            uncovered.append(path)
        else:
            out[path] = prefixes[match]
            used.add(match)
    if uncovered or set(prefixes) - used:
        one = what[:-1] if what.endswith("s") else what
        raise _mismatch(
            f"{what} do not match the params structure:",
            [(f"params with no {one}", uncovered), (f"{what} for paths not in params", sorted(set(prefixes) - used))],
            "give one entry per param path, or a prefix entry (e.g. 'layers') that covers a subtree",
        )
    return out
