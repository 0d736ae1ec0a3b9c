"""Extract, from a torch-npu wheel, the ops torchair can lower to GE graphs without an NPU.

    python tools/extract_torchair_ops.py [--wheel PATH | --version 2.13.0] [--out functional_npu/data/torchair_ops.json]

Downloads the wheel with ``pip download --no-deps`` (it is never installed: without CANN it
breaks ``import torch``), reads torchair's sources inside it with ``ast`` and writes:

* ``converters``: ops with a ``@register_fx_node_ge_converter(...)`` whose body does more than
  raise NotImplementedError (stubs are listed apart, under ``stubs``);
* ``decompositions``: ops torchair rewrites through its default decompositions
  (``get_npu_default_decompositions``), such as ``_c10d_functional.all_to_all_single``.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

TORCHAIR = "torch_npu/dynamo/torchair/"


def _op_name(node: ast.expr) -> str | None:
    """``torch.ops.aten.mm.default`` -> ``aten.mm.default``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    parts.reverse()
    return ".".join(parts[2:]) if parts[:2] == ["torch", "ops"] and len(parts) > 3 else None


def _is_stub(fn: ast.FunctionDef) -> bool:
    body = [
        s
        for s in fn.body
        if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str))
    ]
    first = body[0] if body else None
    if not isinstance(first, ast.Raise) or first.exc is None:
        return False
    exc = first.exc.func if isinstance(first.exc, ast.Call) else first.exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def scan(sources: dict[str, str]) -> dict[str, list[str]]:
    converters, stubs, decomps = set(), set(), set()
    for path, text in sources.items():
        tree = ast.parse(text, filename=path)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    if (
                        isinstance(dec, ast.Call)
                        and getattr(dec.func, "id", getattr(dec.func, "attr", "")) == "register_fx_node_ge_converter"
                    ):
                        op = _op_name(dec.args[0]) if dec.args else None
                        if op:
                            (stubs if _is_stub(node) else converters).add(op)
            if (
                path.endswith("_utils/__init__.py")
                and isinstance(node, ast.Call)
                and getattr(node.func, "attr", "") == "update"
            ):
                for arg in node.args:
                    if isinstance(arg, ast.Dict):
                        decomps.update(op for op in map(_op_name, arg.keys) if op)
    return {"converters": sorted(converters), "stubs": sorted(stubs - converters), "decompositions": sorted(decomps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", help="a torch_npu wheel already on disk")
    parser.add_argument("--version", default="2.13.0", help="torch-npu version to download")
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[1] / "functional_npu" / "data" / "torchair_ops.json")
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel
        if wheel is None:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--only-binary=:all:",
                    f"torch-npu=={args.version}",
                    "-d",
                    tmp,
                ],
                check=True,
            )
            wheel = str(next(Path(tmp).glob("torch_npu-*.whl")))
        with zipfile.ZipFile(wheel) as z:
            sources = {n: z.read(n).decode() for n in z.namelist() if n.startswith(TORCHAIR) and n.endswith(".py")}
    result = {"wheel": Path(wheel).name, **scan(sources)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{args.out}: {len(result['converters'])} converters, {len(result['stubs'])} stubs, "
        f"{len(result['decompositions'])} decompositions"
    )


if __name__ == "__main__":
    main()
