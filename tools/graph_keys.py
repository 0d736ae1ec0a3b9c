"""The content key of each golden case: what its artifacts were made from, so only the cases whose inputs changed are
regenerated (``python -m tools.graphs``) and checked (``tests/tools/test_graphs.py``).

A case's inputs are the source of every module the regeneration imports (the package's and these tools', found by
reading their imports, inside functions too), except the model families other than the case's own (the family
registry imports them all; a case runs one), plus torch's and Python's versions and the torch-npu wheel the
conversions read (named in :mod:`functional_npu.npu.wheel`, whose source is among the inputs). ``graphs/keys.json``
holds each case's key as last written; a case whose key differs, or that has no key, is stale.
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

__all__ = ["KEYS_FILE", "case_key", "keys", "stale", "read_keys", "write_keys", "sources"]

ROOT = Path(__file__).resolve().parents[1]
KEYS_FILE = "keys.json"
ENTRY = "tools.graphs"  # the regeneration's entry point: its import closure is what every case may depend on
FAMILY_MODULES = ("llama", "moe", "deepseek", "gemma3", "mla")  # models/ modules only some cases run


def _module_file(name: str, root: Path) -> Path | None:
    path = root.joinpath(*name.split("."))
    for file in (path.with_suffix(".py"), path / "__init__.py"):
        if file.is_file():
            return file
    return None


def _imports(file: Path, module: str, root: Path) -> set[str]:
    """The package's and the tools' modules ``file`` imports, at module level and inside functions."""
    package = module.split(".") if file.name == "__init__.py" else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n.split(".")[0] in ("functional_npu", "tools") and _module_file(n, root)}
    return out


def sources(family: str | None = None, root: Path = ROOT) -> list[Path]:
    """Every source file the regeneration of a case of ``family`` (a module of ``models/``; None: every family's)
    reads: the import closure of :data:`ENTRY`, less the other families' modules. Each package's ``__init__`` on the
    way is included (importing a module runs it)."""
    seen: set[str] = set()
    todo = [ENTRY]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages it is in
        todo += sorted(_imports(_module_file(name, root), name, root) - seen)
    own = _family_closure(family, root) if family is not None else set(FAMILY_MODULES)
    skip = {f"functional_npu.models.{m}" for m in FAMILY_MODULES} - {f"functional_npu.models.{m}" for m in own}
    return sorted({_module_file(n, root) for n in seen if n not in skip})


def _family_closure(family: str, root: Path) -> set[str]:
    """The family modules ``family``'s module imports, itself included (``moe`` reads ``llama``'s blocks)."""
    out, todo = set(), [family]
    while todo:
        m = todo.pop()
        if m in out:
            continue
        out.add(m)
        name = f"functional_npu.models.{m}"
        deps = _imports(_module_file(name, root), name, root)
        todo += [d.rsplit(".", 1)[1] for d in deps if d.rsplit(".", 1)[1] in FAMILY_MODULES and "models" in d]
    return out


def case_key(family: str, read: Callable[[Path], bytes] = Path.read_bytes, root: Path = ROOT) -> str:
    """The key of a case of ``family``: a digest of its sources' paths and bytes (``read``) and the versions."""
    h = hashlib.sha256()
    h.update(f"torch {torch.__version__}, python {platform.python_version_tuple()[:2]}".encode())
    for file in sources(family, root):
        h.update(str(file.relative_to(root)).encode() + b"\0" + read(file) + b"\0")
    return h.hexdigest()[:24]


def keys(cases: Iterable[tuple[str, str]]) -> dict[str, str]:
    """``{case name: key}`` for ``(name, family module)`` pairs (one digest per family)."""
    by_family: dict[str, str] = {}
    out = {}
    for name, family in cases:
        if family not in by_family:
            by_family[family] = case_key(family)
        out[name] = by_family[family]
    return out


def read_keys(root: Path) -> dict[str, str]:
    """The keys written with the artifacts under ``root`` (``{}`` without a keys file)."""
    file = root / KEYS_FILE
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_keys(root: Path, new: dict[str, str]) -> None:
    """Record ``new`` keys beside the ones already written (the cases regenerated now)."""
    merged = dict(sorted((read_keys(root) | new).items()))
    (root / KEYS_FILE).write_text(json.dumps(merged, indent=1) + "\n")


def stale(root: Path, current: dict[str, str]) -> list[str]:
    """The cases whose written key is not ``current``'s, or whose artifacts are missing."""
    written = read_keys(root)
    return sorted(n for n, k in current.items() if written.get(n) != k or not (root / n / "graph.txt").is_file())
