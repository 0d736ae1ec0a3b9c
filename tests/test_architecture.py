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


def _family_knowledge() -> tuple[set[str], set[str], set[str]]:
    """(family modules, family config classes, family-specific leaves): what only ``models/`` may name. Leaves
    every family shares (the decoder's params form, the experts block's, the module-TP vocabulary of the plan)
    are generic."""
    from functional_npu.models import FAMILIES, decoder, experts
    from functional_npu.parallel.module_tp import MODULES

    modules = {f.config.__module__.rsplit(".", 1)[1] for f in FAMILIES}
    configs = {f.config.__name__ for f in FAMILIES}
    leaves = {leaf for f in FAMILIES for leaf in f.layer_leaves + tuple(f.linears)}
    return modules, configs, leaves - set(decoder.COMMON_LEAVES) - set(experts.LEAVES) - set(MODULES)


def _outside_models() -> list[Path]:
    return [f for f in sorted(PACKAGE.rglob("*.py")) if f.relative_to(PACKAGE).parts[0] != "models"]


def test_no_family_or_family_leaf_is_named_outside_models():
    """A family is its module under models/ and one registry line: no other code imports a family module or
    config, or names one of a family's own leaves."""
    modules, configs, leaves = _family_knowledge()
    assert {"llama", "deepseek"} <= modules and {"qkv", "kv_b_proj"} <= leaves  # the check sees the families
    bad = []
    for file in _outside_models():
        for node in ast.walk(ast.parse(file.read_text())):
            where = f"{file.relative_to(PACKAGE)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                parts = module.split(".")
                if set(parts) & modules and "models" in parts:
                    bad.append(f"{where} imports {module}")
                bad += [f"{where} imports {a.name}" for a in node.names if a.name in configs | modules]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in leaves:
                bad.append(f"{where} names the leaf {node.value!r}")
    assert not bad, "family knowledge outside models/:\n" + "\n".join(bad)
