"""The content key of each golden case: what its artifacts were made from, so only the cases whose inputs changed are
regenerated (``python -m tools.graphs``) and checked (``tests/tools/test_graphs.py``).

A case's inputs are the code (:func:`code_tokens`: the tokens, without docstrings, comment lines and blank lines) of
every module the regeneration imports (the package's and these tools', found by
reading their imports, inside functions too), except the model families other than the case's own (the family
registry imports them all; a case runs one), plus torch's and Python's versions and the torch-npu wheel the
conversions read (named in :mod:`functional_npu.npu.wheel`, whose source is among the inputs). ``graphs/keys.json``
holds each case's key as last written; a case whose key differs, or that has no key, is stale.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import platform
import tokenize
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

__all__ = ["KEYS_FILE", "case_key", "code_tokens", "keys", "stale", "read_keys", "write_keys", "sources"]

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


_LINE_STARTS = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)


def _docstrings(source: str) -> set[tuple[int, int]]:
    """The (line, column) where each docstring (a module's, class's or function's first statement, a string) starts."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out.add((first.lineno, first.col_offset))
    return out


def code_tokens(source: bytes) -> bytes:
    """What of a module's source can reach a golden artifact: its tokens, less its docstrings, the comments that stand
    on a line of their own and blank lines. A comment after code stays (the FX graph's annotations quote each traced
    line whole), and so does where a statement is wrapped; the spaces between tokens do not (the formatter owns them).
    """
    text = source.decode()
    docs = _docstrings(text)
    out, previous, skip_line = [], tokenize.NEWLINE, 0
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING and previous in _LINE_STARTS and tok.start in docs:
            skip_line = tok.end[0]  # the docstring and the NEWLINE that ends its statement
            continue
        if skip_line and tok.type == tokenize.NEWLINE and tok.start[0] == skip_line:
            skip_line = 0
            continue
        lone = tok.type == tokenize.COMMENT and previous in _LINE_STARTS
        blank = tok.type == tokenize.NL and previous in _LINE_STARTS
        if lone or blank:
            continue
        out.append(f"{tok.type}:{tok.string}")
        previous = tok.type
    return "\n".join(out).encode()


def _code(file: Path, read: Callable[[Path], bytes]) -> bytes:
    return code_tokens(read(file)) if file.suffix == ".py" else read(file)


def case_key(family: str, read: Callable[[Path], bytes] = Path.read_bytes, root: Path = ROOT) -> str:
    """The key of a case of ``family``: a digest of its sources' paths and code (:func:`code_tokens` of ``read``) and
    the versions."""
    h = hashlib.sha256()
    h.update(f"torch {torch.__version__}, python {platform.python_version_tuple()[:2]}".encode())
    for file in sources(family, root):
        h.update(str(file.relative_to(root)).encode() + b"\0" + _code(file, read) + b"\0")
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
