"""The package's folders are its layers: imports run one way, core <- parallel <- models <- interop, runtime <- cli
(and npu, standalone, <- cli)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "functional_npu"
# a layer may import from the layers listed for it (and from itself)
ALLOWED = {
    "core": {"core"},
    "parallel": {"core", "parallel"},
    "models": {"core", "parallel", "models"},
    "interop": {"core", "parallel", "models", "interop"},
    "runtime": {"core", "parallel", "models", "runtime"},
    "npu": {"npu"},  # torchair's conversion on this host: standalone, so a conversion process stays small
    "cli": {"core", "parallel", "models", "interop", "runtime", "npu", "cli"},
}


def _imports(file: Path) -> list[tuple[str, int]]:
    """(top-level folder of the package imported, line) for every import of the package in ``file``."""
    folder = list(file.relative_to(PACKAGE).parent.parts)
    out = []
    for node in ast.walk(ast.parse(file.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:  # relative: up (level - 1) folders from the file's own
            path = folder[: len(folder) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            out += [(path[0], node.lineno)] if path else [(a.name, node.lineno) for a in node.names]
        elif (node.module or "").startswith("functional_npu."):
            out.append((node.module.split(".")[1], node.lineno))
    return out


def test_imports_run_one_way():
    bad = []
    for file in sorted(PACKAGE.rglob("*.py")):
        layer = file.relative_to(PACKAGE).parts[0]
        if layer not in ALLOWED:  # __init__.py, __main__.py: the package's front door
            continue
        for target, line in _imports(file):
            if target in ALLOWED and target not in ALLOWED[layer]:
                bad.append(f"{file.relative_to(PACKAGE)}:{line} ({layer}) imports {target}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_private_helper_is_borrowed_across_modules():
    bad = []
    for file in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("functional_npu")):
                bad += [
                    f"{file.relative_to(PACKAGE)}:{node.lineno} imports {a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
    assert not bad, "\n".join(bad)
