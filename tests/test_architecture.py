"""The package's folders are its layers: imports run one way, core <- parallel <- models <- interop, placement <-
runtime <- cli (and checks, the graph checks over core and parallel, <- npu, which reads converted graphs with them,
<- cli). The front door (``import functional_npu``) loads neither checks nor npu. The applications (benchmarks/,
tools/) sit outside it: the package imports nothing of theirs, and no modules import each other in a circle. Each
folder is a face over its modules: the applications and the docs import faces, never a file; no two modules share a
stem; no function runs past 60 lines of code."""

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "functional_npu"
APPS = ("benchmarks", "tools")
# a layer may import from the layers listed for it (and from itself)
ALLOWED = {
    "core": {"core"},
    "parallel": {"core", "parallel"},
    "models": {"core", "parallel", "models"},
    "interop": {"core", "parallel", "models", "interop"},
    # a plan checked against a model and a mesh: the layouts, the stored tensors, the quantized leaves
    "placement": {"core", "parallel", "models", "placement"},
    "runtime": {"core", "parallel", "models", "placement", "runtime"},
    # the checks users run on their own graphs: the prefetch ring's hazard check and the programs it reads
    "checks": {"core", "parallel", "checks"},
    # torchair's and npugraph_ex's conversions on this host, checked with the ring's hazard check (checks)
    "npu": {"core", "parallel", "checks", "npu"},
    "cli": {"core", "parallel", "models", "interop", "placement", "runtime", "checks", "npu", "cli"},
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


def test_no_family_imports_another():
    """Each family builds on the shared blocks (the dense decoder, attention, experts, ...), as torchtitan's families
    build on its common helpers: no family module imports another."""
    modules, _, _ = _family_knowledge()
    graph = _import_graph(["functional_npu"], functions=True)
    family = {f"functional_npu.models.{m}" for m in modules}
    bad = sorted(f"{m} imports {d}" for m in family for d in graph[m] & family)
    assert not bad, "families importing families:\n" + "\n".join(bad)


def test_the_package_imports_no_application():
    """benchmarks/ and tools/ are applications of the package, not installed with it: nothing in it imports them
    (inside functions neither)."""
    bad = []
    for file in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            bad += [f"{file.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in APPS]
    assert not bad, "the package imports an application:\n" + "\n".join(bad)


def _module(file: Path, root: Path) -> str:
    parts = file.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_run(body: list[ast.stmt], functions: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports that run when ``body`` runs: at module level, and with ``functions`` inside functions too (never
    the ones under ``if TYPE_CHECKING:``, which never run)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            yield from _imports_run([] if _type_checking(node) else node.body, functions)
            yield from _imports_run(node.orelse, functions)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _imports_run(node.body, functions) if functions else ()
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _imports_run(block, functions)
        elif isinstance(node, (ast.ClassDef, ast.With, ast.For, ast.While)):
            yield from _imports_run(node.body, functions)


def _import_graph(folders: list[str], *, functions: bool, root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules under ``folders`` it imports by name (``from . import x``, ``from ..x import y``,
    ``import functional_npu.x``); a package's ``__init__`` is ``functional_npu.x``."""
    files = {_module(f, root): f for folder in folders for f in sorted((root / folder).rglob("*.py"))}
    graph = {}
    for name, file in files.items():
        package = name.split(".") if file.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in _imports_run(ast.parse(file.read_text()).body, functions):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
                continue
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            module = ".".join(p for p in (base, node.module or "") if p)
            submodules = {f"{module}.{a.name}" for a in node.names} & files.keys()  # from . import x, from .x import y
            deps |= submodules | ({module} if node.module or not submodules else set())
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle, each once, from its smallest module. A cycle lies inside one strongly connected
    component, so only components of more than one module (or a module importing itself) are searched: walking
    every path of the whole graph took tens of seconds, and the package has no cycle."""
    found = []
    for component in _components(graph):
        sub = {n: graph[n] & component for n in component}

        def walk(start: str, path: list[str], sub: dict[str, set[str]] = sub) -> None:
            for nxt in sorted(sub[path[-1]]):
                if nxt == start:
                    found.append([*path, start])
                elif nxt > start and nxt not in path:
                    walk(start, [*path, nxt])

        for start in sorted(component):
            walk(start, [start])
    return sorted(found)


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components that can hold a cycle (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    out.append(component)
    return out


def test_no_import_cycles_at_module_level():
    """Among the package's and the applications' modules, counting the imports that run at import time (not those
    inside functions or under ``if TYPE_CHECKING:``)."""
    cycles = _cycles(_import_graph(["functional_npu", *APPS], functions=False))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_circles_held_apart_by_imports_in_functions():
    """The command line and the applications: not even an import inside a function closes a circle (the benchmarks
    and golden-graph modules once did, when they lived in cli/)."""
    cycles = _cycles(_import_graph(["functional_npu/cli", *APPS], functions=True))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_check_sees_a_circle(tmp_path):
    """The check itself: two modules importing each other, one inside a function, close a circle only when imports in
    functions count; an import under ``if TYPE_CHECKING:`` never does."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from . import b\n")
    (tmp_path / "pkg" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\ndef f():\n    from .a import y\n"
    )
    assert _cycles(_import_graph(["pkg"], functions=False, root=tmp_path)) == []
    assert _cycles(_import_graph(["pkg"], functions=True, root=tmp_path)) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_no_import_hides_behind_type_checking():
    """Shared blocks are typed by the fields they read (a Protocol), so no module imports another of the package
    only for type checking (the way import circles were held apart)."""
    bad = [
        f"{file.relative_to(PACKAGE)}:{node.lineno}"
        for file in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(file.read_text()))
        if isinstance(node, ast.If) and _type_checking(node)
    ]
    assert not bad, "imports under TYPE_CHECKING:\n" + "\n".join(bad)


def _exports(package: Path) -> set[str]:
    """The names a package's face (its ``__init__.py``) lists in ``__all__``."""
    for node in ast.parse((package / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return {e.value for e in node.value.elts}
    return set()


def _is_face(module: str, root: Path = ROOT) -> bool:
    """A package (a folder with a face), or a module its package's face exports as a module (``from . import llama``
    and ``"llama"`` in ``__all__``: a family is one)."""
    path = root.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return True
    face = path.parent / "__init__.py"
    if not face.is_file() or path.name not in _exports(path.parent):
        return False
    return any(
        isinstance(node, ast.ImportFrom)
        and node.level == 1
        and not node.module
        and path.name in {a.name for a in node.names}
        for node in ast.parse(face.read_text()).body
    )


def _app_and_doc_imports() -> list[tuple[str, str]]:
    """(where, module) for every ``from functional_npu... import`` in the applications and the docs' code."""
    out = []
    for file in sorted(p for app in APPS for p in (ROOT / app).rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("functional_npu"):
                out.append((f"{file.relative_to(ROOT)}:{node.lineno}", node.module))
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            if m := re.match(r"\s*from (functional_npu[\w.]*) import ", line):
                out.append((f"{doc.relative_to(ROOT)}:{i}", m.group(1)))
    return out


def test_applications_and_docs_import_faces_not_files():
    imports = _app_and_doc_imports()
    assert len(imports) > 50  # the check sees them
    bad = [f"{where} imports {module}" for where, module in imports if not _is_face(module)]
    assert not bad, "import the folder's face (its __init__ lists the name), not a file:\n" + "\n".join(bad)


def test_the_face_check_refuses_a_file(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('from . import family\nfrom .a import a\n__all__ = ["a", "family"]\n')
    assert _is_face("pkg", tmp_path) and _is_face("pkg.family", tmp_path)
    assert not _is_face("pkg.a", tmp_path)  # a module named like a name its face exports is still a file


def test_no_two_modules_share_a_stem():
    stems: dict[str, list[str]] = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        if file.name not in ("__init__.py", "__main__.py"):
            stems.setdefault(file.stem, []).append(str(file.relative_to(PACKAGE)))
    bad = {stem: files for stem, files in stems.items() if len(files) > 1}
    assert not bad, f"one name, one module: {bad}"


MAX_LINES = 60  # code lines of a function: its body without the docstring, blank lines and comment lines


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    if not body:
        return 0
    text = lines[body[0].lineno - 1 : node.end_lineno]
    return sum(1 for line in text if line.strip() and not line.strip().startswith("#"))


def _long_functions(root: Path) -> list[str]:
    out = []
    for file in sorted(root.rglob("*.py")):
        lines = file.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "build_parser":
                n = _code_lines(node, lines)
                if n > MAX_LINES:
                    out.append(f"{file.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_runs_past_60_lines():
    """The argparse table (``build_parser``) excepted."""
    bad = _long_functions(PACKAGE)
    assert not bad, f"split these into functions of at most {MAX_LINES} code lines:\n" + "\n".join(bad)


def test_the_length_check_counts_code_lines(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(61))
    (tmp_path / "pkg" / "a.py").write_text(f'def f():\n    """doc"""\n    # note\n\n{body}\ndef g():\n    return 1\n')
    assert _long_functions(tmp_path / "pkg") == ["pkg/a.py:1 f (61 lines)"]


def _bound_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level (definitions, assignments, imports; under ``if`` / ``try`` too)."""
    out: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return out


def _unresolved_imports(root: Path, package: str) -> list[str]:
    """Every ``from <package module> import name`` in ``root/package`` (inside functions too) whose module has no file,
    or whose name is neither a submodule of it nor a name it binds: an import that fails when that line runs."""
    bad = []
    for file in sorted((root / package).rglob("*.py")):
        name = _module(file, root)
        parts = name.split(".") if file.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith(package)):
                continue
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            path = root.joinpath(*module.split("."))
            target = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            where = f"{file.relative_to(root)}:{node.lineno}"
            if not target.is_file():
                bad.append(f"{where}: no module {module}")
                continue
            bound = _bound_names(ast.parse(target.read_text()))
            for a in node.names:
                sub = path / a.name
                if a.name != "*" and a.name not in bound and not (sub.with_suffix(".py").is_file() or sub.is_dir()):
                    bad.append(f"{where}: {module} has no {a.name}")
    return bad


def test_every_import_of_the_package_resolves():
    """Inside functions too, where only the line's first run would find it (``backends._torchair`` imported
    ``ge_converters`` from a folder it had left: the first NPU would have raised ImportError)."""
    bad = _unresolved_imports(ROOT, "functional_npu")
    assert not bad, "imports that fail when they run:\n" + "\n".join(bad)


def test_the_import_check_finds_a_moved_module(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("from .a import f\n")
    (tmp_path / "pkg" / "sub" / "a.py").write_text("def f():\n    from .. import gone\n    from . import b, c\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("")
    want = ["pkg/sub/a.py:2: pkg has no gone", "pkg/sub/a.py:3: pkg.sub has no c"]
    assert _unresolved_imports(tmp_path, "pkg") == want


def _all_assignments(face: Path) -> list[ast.stmt]:
    out = []
    for node in ast.parse(face.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out += [node] if any(getattr(t, "id", "") == "__all__" for t in targets) else []
    return out


def test_every_face_lists_its_exports_once_and_binds_them():
    """A second ``__all__ = [...]`` replaces the first (``runtime/``'s face once exported one name of eight)."""
    bad = []
    for face in sorted(PACKAGE.rglob("__init__.py")):
        where = face.relative_to(ROOT)
        found = _all_assignments(face)
        if len(found) != 1 or not isinstance(found[0], ast.Assign):
            bad.append(f"{where}: {len(found)} assignments of __all__ (one plain list, please)")
            continue
        listed = [e.value for e in found[0].value.elts]
        bound = _bound_names(ast.parse(face.read_text()))
        bad += [f"{where}: {name!r} listed twice" for name in sorted({n for n in listed if listed.count(n) > 1})]
        bad += [f"{where}: lists {name!r}, which it does not bind" for name in listed if name not in bound]
    assert not bad, "\n".join(bad)


# Run in a fresh interpreter: record, for every module of ``banned`` the import loads, the module whose code imported
# it (the first frame outside importlib), then print {module: importer} for those loaded.
_WATCH = """
import json, sys

banned = tuple(sys.argv[1:])


class Watch:
    importer = {}

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in banned):
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "__main__")):
                frame = frame.f_back
            cls.importer.setdefault(name, frame.f_globals.get("__name__") if frame is not None else None)
        return None


sys.meta_path.insert(0, Watch)
import functional_npu

print(json.dumps({m: Watch.importer.get(m) for m in sorted(sys.modules) if m in Watch.importer}))
"""


def _loaded_by_import(banned: tuple[str, ...]) -> dict[str, str | None]:
    """{module of ``banned`` (a package and what is under it): the module that imported it} for every one that
    ``import functional_npu`` loads in a fresh interpreter, run from the repository root (where ``tools`` is found)."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _WATCH, *banned], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_front_door_imports_no_checker_and_no_npu_toolkit():
    """``import functional_npu`` loads neither the graph checks (``checks/``), nor the converted-graph toolkit
    (``npu/``), nor an application (``tools``): a user's program pays for what it uses."""
    loaded = _loaded_by_import(("functional_npu.checks", "functional_npu.npu", "tools"))
    bad = [f"{module} (imported by {importer})" for module, importer in loaded.items()]
    assert not bad, "import functional_npu loads:\n" + "\n".join(bad)


def test_the_import_watch_names_the_importer():
    assert _loaded_by_import(("functional_npu.core.tree",))["functional_npu.core.tree"].startswith("functional_npu.")


def test_no_application_imports_another():
    """The command line is an application of the package, as benchmarks/ and tools/ are: none of them imports the
    others (the embedded models they share are the package's, :mod:`functional_npu.models.embedded`)."""
    bad = [
        f"{where} imports {module}"
        for where, module in _app_and_doc_imports()
        if module.startswith("functional_npu.cli")
    ]
    assert not bad, "\n".join(bad)


_STATIC_KEYS = re.compile(r"""\[["'](config|placement)["']\]|\.get\(["'](config|placement)["']|["']placement["']\s*:""")


def _static_key_uses(files: list[Path]) -> list[str]:
    """Where a model config or a placement is read from, or put in, a params tree under a string key."""
    out = []
    for file in files:
        for i, line in enumerate(file.read_text().splitlines(), 1):
            if _STATIC_KEYS.search(line) and "json" not in line:
                where = file.relative_to(ROOT) if ROOT in file.parents else file.name
                out.append(f"{where}:{i}: {line.strip()}")
    return out


def test_placed_params_carry_their_config_and_placement_as_fields():
    """``params.config`` and ``params.placement`` (:class:`functional_npu.Params`), never ``params["config"]`` or a
    placement glued on with ``| {"placement": ...}``: in the package, the applications, the docs and the tests (the
    refusal of a static key is tested in tests/placement/test_placement.py and tests/core/test_params.py)."""
    files = [p for folder in ("functional_npu", *APPS) for p in sorted((ROOT / folder).rglob("*.py"))]
    files += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += [
        p for p in sorted((ROOT / "tests").rglob("*.py")) if p.name not in ("test_placement.py", "test_params.py")
    ]
    files = [p for p in files if p.resolve() != Path(__file__).resolve()]
    bad = _static_key_uses(files)
    assert not bad, "\n".join(bad)


def test_the_static_key_check_finds_a_glued_placement(tmp_path):
    (tmp_path / "a.py").write_text('p = shard(full, specs, mesh) | {"placement": place(cfg, mesh)}\nc = p["config"]\n')
    assert len(_static_key_uses([tmp_path / "a.py"])) == 2


# The types a public function returns or raises: an application names them (annotations, isinstance, except) though
# nothing here imports them through the face.
FACE_TYPES = {
    "functional_npu": {"ReshardPlan"},
    "functional_npu.models": {"ARCHITECTURES"},
    "functional_npu.parallel": {"Ring", "RingGroup"},
    "functional_npu.placement": {"RingMemory"},
    "functional_npu.runtime": {"RemoteError"},
    "functional_npu.runtime.planning": {"Estimate", "Served", "Report"},
    "functional_npu.runtime.serving": {"Samples"},
    "functional_npu.runtime.training": {"OptState", "TrainStep", "StepStats", "group_advantages"},
}


def _faces(root: Path) -> dict[str, set[str]]:
    """Every face of the package under ``root``: its exports by its module name."""
    return {_module(face, root): _exports(face.parent) for face in (root / "functional_npu").rglob("__init__.py")}


def _through_faces(files: list[Path], faces: dict[str, set[str]], root: Path) -> dict[str, set[str]]:
    """The names each face gives to ``files``: ``from face import name`` (absolute, or relative from outside the
    face's own ``__init__``) and ``face.name`` where ``face`` is a name bound to the face module."""
    used: dict[str, set[str]] = {face: set() for face in faces}
    for file in files:
        here, face = _module(file, root), file.name == "__init__.py"
        package = here if face else here.rsplit(".", 1)[0]
        bound: dict[str, str] = {}
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
                if module in faces and not (face and module == here):
                    used[module] |= {a.name for a in node.names}
                bound |= {a.asname or a.name: f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in faces}
            elif isinstance(node, ast.Import):
                bound |= {a.asname or a.name: a.name for a in node.names if a.name in faces}
        for node in ast.walk(ast.parse(file.read_text())):
            chain, value = [], node
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if chain and isinstance(value, ast.Name):
                names = [bound.get(value.id, value.id), *reversed(chain)]
                full = names[0].split(".") + names[1:]
                for i in range(1, len(full)):
                    if ".".join(full[:i]) in used:
                        used[".".join(full[:i])].add(full[i])
    return used


def _unused_exports(root: Path, apps: tuple[str, ...], docs: str, types: dict[str, set[str]]) -> list[str]:
    faces = _faces(root)
    files = [p for folder in ("functional_npu", *apps) for p in sorted((root / folder).rglob("*.py"))]
    used = _through_faces(files, faces, root)
    return [
        f"{face}: {name}"
        for face, names in sorted(faces.items())
        for name in sorted(names)
        if name not in used[face] and name not in types.get(face, ()) and not re.search(rf"\b{re.escape(name)}\b", docs)
    ]


def test_every_face_exports_only_what_something_imports_through_it():
    """A face lists what an application uses (issue 54: 109 of 382 exported names were imported through their face
    by nothing); an internal name is imported from its module inside the package. The users counted: the package,
    the tests, tools and benchmarks, and the docs' text; the returned and raised types in FACE_TYPES besides."""
    docs = " ".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    unused = _unused_exports(ROOT, ("tests", *APPS), docs, FACE_TYPES)
    assert not unused, "exported through a face that nothing imports it through:\n" + "\n".join(unused)


def test_the_export_check_finds_an_unused_name(tmp_path):
    pkg = tmp_path / "functional_npu"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('from .sub import a\n__all__ = ["a"]\n')
    (pkg / "sub" / "__init__.py").write_text('from .m import a, b, c\n__all__ = ["a", "b", "c"]\n')
    (pkg / "sub" / "m.py").write_text("a = b = c = 1\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "x.py").write_text(
        "from functional_npu import a\nimport functional_npu.sub as s\nprint(a, s.b)\n"
    )
    assert _unused_exports(tmp_path, ("app",), "", {}) == ["functional_npu.sub: c"]
    assert _unused_exports(tmp_path, ("app",), "see c", {}) == []
