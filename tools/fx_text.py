"""FX graphs rebuilt from their printed text: :func:`parse_fx_text` reads ``GraphModule.print_readable``'s code (a
golden ``graph.txt``) or ``str(graph)`` (a golden ``acl_graph.txt``) back into a ``torch.fx.Graph``, so a stored graph
is checked (``functional_npu.checks.from_fx``, the NPU toolkit's capture order) without the compiler that made it.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from functional_npu.core import broadcast_into  # noqa: F401 - defines functional_npu::broadcast_into (a graph's op)

__all__ = ["parse_fx_text"]

_DTYPES = {
    "f64": torch.float64,
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i64": torch.int64,
    "i32": torch.int32,
    "i16": torch.int16,
    "i8": torch.int8,
    "u8": torch.uint8,
    "b8": torch.bool,
}


class _Target:
    """An op named in a printed graph that this process does not define (npugraph_ex's event ops): its name only."""

    def __init__(self, name: str) -> None:
        self.name = name.removeprefix("torch.ops.")
        module, _, self.__name__ = name.rpartition(".")
        if module.startswith("torch.ops."):  # printed back as it was: torch.ops.<namespace>.<op>.<overload>
            module, _, op = module.rpartition(".")
            self.__name__ = f"{op}.{self.__name__}"
        self.__module__ = module

    def __call__(self, *_: Any, **__: Any) -> Any:
        raise RuntimeError(f"{self.name}: an op read from a printed graph, not run here")

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__


def _target(name: str) -> Callable[..., Any]:
    if name in ("operator.getitem", "<built-in function getitem>"):
        return operator.getitem
    if name.startswith("torch.ops."):
        obj: Any = torch.ops
        try:
            for part in name.split(".")[2:]:
                obj = getattr(obj, part)
            return obj
        except (AttributeError, RuntimeError):
            return _Target(name)
    return _Target(name)


def _meta_val(annotation: str | None) -> torch.Tensor | None:
    m = re.fullmatch(r"(\w+)\[([\d, ]*)\]", annotation or "")
    if not m or m.group(1) not in _DTYPES:
        return None
    shape = [int(d) for d in m.group(2).split(",") if d.strip()]
    return torch.empty(shape, dtype=_DTYPES[m.group(1)], device="meta")


def parse_fx_text(text: str, inputs: Sequence[str | None] | None = None) -> torch.fx.Graph:
    """An FX graph rebuilt from its printed text: ``GraphModule.print_readable``'s code (a golden ``graph.txt``) or
    ``str(graph)`` (a golden ``acl_graph.txt``), with the same node names, targets and arguments, and each
    placeholder's ``meta["input_path"]`` from ``inputs`` (the layout) when given. Ops this process does not define
    keep their name as their target (``str(node.target)`` reads as the op's)."""
    graph = _parse_code(text) if "def forward(" in text else _parse_str(text)
    if inputs is not None:
        for n, path in zip((n for n in graph.nodes if n.op == "placeholder"), inputs):
            n.meta["input_path"] = path
    return graph


def _value(e: ast.expr, env: dict[str, Any]) -> Any:
    """The value of an argument in ``print_readable``'s code: a node (by its name), a literal, a dtype, a device."""
    if isinstance(e, ast.Constant):
        return e.value
    if isinstance(e, ast.Name):
        return env[e.id] if e.id in env else {"inf": math.inf, "nan": math.nan}.get(e.id, e.id)
    if isinstance(e, (ast.List, ast.Tuple)):
        items = [_value(x, env) for x in e.elts]
        return items if isinstance(e, ast.List) else tuple(items)
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        return -_value(e.operand, env)
    if isinstance(e, ast.Attribute):
        dotted = ast.unparse(e)
        if dotted.startswith("torch.ops."):
            return _target(dotted)
        obj: Any = torch
        for part in dotted.split(".")[1:]:
            obj = getattr(obj, part)
        return obj
    if isinstance(e, ast.Call) and ast.unparse(e.func) in ("device", "float"):
        args = [_value(a, env) for a in e.args]
        kwargs = {kw.arg: _value(kw.value, env) for kw in e.keywords}
        return torch.device(*args, **kwargs) if ast.unparse(e.func) == "device" else float(*args)
    raise ValueError(f"parse_fx_text: cannot read {ast.unparse(e)!r}")


def _parse_code(text: str) -> torch.fx.Graph:
    tree = ast.parse(re.sub(r"^class .*:$", "class G:", text, count=1, flags=re.M))  # ``class <lambda>(...)``
    forward = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward")
    graph = torch.fx.Graph()
    env: dict[str, Any] = {}
    for a in forward.args.args[1:]:
        node = graph.placeholder(a.arg)
        ann = a.annotation.value if isinstance(a.annotation, ast.Constant) else None
        if (val := _meta_val(ann)) is not None:
            node.meta["val"] = val
        env[a.arg] = node
    for stmt in forward.body:
        if isinstance(stmt, ast.Return):
            graph.output(_value(stmt.value, env) if stmt.value is not None else None)
            continue
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and stmt.value.value is None:
            continue  # ``a = b = None``: the printer's frees
        if isinstance(stmt, ast.AnnAssign):
            name, rhs, ann = stmt.target.id, stmt.value, getattr(stmt.annotation, "value", None)
        elif isinstance(stmt, ast.Assign):
            name, rhs, ann = stmt.targets[0].id, stmt.value, None
        elif isinstance(stmt, ast.Expr):
            name, rhs, ann = None, stmt.value, None
        else:
            raise ValueError(f"parse_fx_text: cannot read {ast.unparse(stmt)!r}")
        if isinstance(rhs, ast.Subscript):
            args, kwargs, target = (_value(rhs.value, env), _value(rhs.slice, env)), {}, operator.getitem
        elif isinstance(rhs, ast.Call):
            target = _target(ast.unparse(rhs.func))
            args = tuple(_value(a, env) for a in rhs.args)
            kwargs = {kw.arg: _value(kw.value, env) for kw in rhs.keywords}
        else:
            raise ValueError(f"parse_fx_text: cannot read {ast.unparse(stmt)!r}")
        node = graph.create_node("call_function", target, args, kwargs, name=name)
        if (val := _meta_val(ann)) is not None:
            node.meta["val"] = val
        env[node.name] = node
    return graph


_STR_NODE = re.compile(
    r"%(\w+) : \[num_users=\d+\] = (\w+)\[target=([^\]]+)\](?:\(args = \((.*)\), kwargs = \{(.*)\}\))?$"
)
_TOKEN = re.compile(r"\s*(%\w+|[\[\](){},:]|[^\s\[\](){},:%][^\[\](){},:]*)")


def _parse_str(text: str) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}

    def atoms(src: str, bare: bool = False) -> list[Any]:
        """The comma-separated values of ``src`` (``str(graph)`` prints strings bare and names nodes ``%x``; its
        ``return`` line names them bare: ``bare``)."""
        tokens = [t for t in _TOKEN.findall(src) if t.strip()]
        pos = 0

        def one() -> Any:
            nonlocal pos
            t = tokens[pos]
            pos += 1
            if t in ("[", "("):
                close = "]" if t == "[" else ")"
                items = []
                while tokens[pos] != close:
                    items.append(one())
                    if tokens[pos] == ",":
                        pos += 1
                pos += 1
                return items if t == "[" else tuple(items)
            if t == "{":
                d = {}
                while tokens[pos] != "}":
                    key = one()
                    pos += 1  # ':'
                    d[key] = one()
                    if tokens[pos] == ",":
                        pos += 1
                pos += 1
                return d
            return env[t.strip()] if bare and t.strip() in env else _atom(t.strip(), env)

        out = []
        while pos < len(tokens):
            out.append(one())
            if pos < len(tokens) and tokens[pos] == ",":
                pos += 1
        return out

    for line in text.splitlines():
        line = line.strip()
        if line.startswith("return"):
            rest = line[len("return") :].strip()
            got = atoms(rest, bare=True)
            graph.output(got[0] if len(got) == 1 else tuple(got))
            continue
        m = _STR_NODE.match(line)
        if not m:
            continue
        name, op, target, args, kwargs = m.groups()
        if op == "placeholder":
            env[name] = graph.placeholder(name)
            continue
        if op != "call_function":
            raise ValueError(f"parse_fx_text: cannot read a {op} node ({line[:80]})")
        kw = atoms("{" + (kwargs or "") + "}")[0] if kwargs else {}
        env[name] = graph.create_node("call_function", _target(target), tuple(atoms(args or "")), kw, name=name)
    return graph


def _atom(t: str, env: dict[str, torch.fx.Node]) -> Any:
    if t.startswith("%"):
        return env[t[1:]]
    if t in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[t]
    if t in ("inf", "-inf", "nan"):
        return float(t)
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        pass
    if t.startswith("torch.") and isinstance(getattr(torch, t[6:], None), (torch.dtype, torch.memory_format)):
        return getattr(torch, t[6:])
    return t
