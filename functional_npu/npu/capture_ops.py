"""Which ops ACL graph capture takes inside the captured region, read from torch-npu's own table of how it runs each.

torch_npu's graph capture records aclnn kernels (an op's ``op_api`` implementation). An aclop (the older ``acl_op``
path) inside the captured region aborts it: ``Cannot run aclop operators during NPU graph capture``, then error
107025 at capture end (the stream left unjoined). The reported case is a weight kept in the NPU's fractal (NZ) format
and fetched from host memory, where each copy needs an ND -> NZ cast: ``npu_format_cast`` runs as the aclop
``Identity``, so a format cast belongs outside capture (or the slot holds the stored format). An op torch-npu has no
kernel for does not run on the NPU at all.

torch-npu's table (``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` in its wheel,
:func:`functional_npu.npu.wheel.op_table`) lists each op it implements with ``impl_ns``: ``op_api`` (aclnn),
``acl_op``, ``dvm``; an op listed without one is torch-npu's own C++ (views, copies, factories, which pick the
aclnn path for ND tensors). :func:`parse_table` reads it (no YAML library: the table's own plain subset) and
:func:`problems` checks a captured region's ops, one line each:

- **format cast**: ``npu_format_cast`` and its variants (torch-npu's own; an aclop on the released torch-npu);
- **aclop**: an op torch-npu implements only with ``acl_op``;
- **no NPU kernel**: an aten op not in the table that is neither a view nor a composite of other ops (the
  dispatcher's ``CompositeImplicitAutograd`` / ``CompositeExplicitAutograd`` kernels run it as other ops);
- **reference on the NPU**: this library's custom op without a kernel for the NPU (``PrivateUse1``): it would run
  its reference implementation's ops there; one with such a kernel must name the torch-npu op it calls
  (:data:`functional_npu.models.ascend_ops.NPU_KERNELS`), and that op must be aclnn.

Allowed without the table: the collectives (``_c10d_functional``, npugraph_ex's ``npu_define`` HCCL ops, this
library's ``broadcast_into``), npugraph_ex's events and stream scopes, and ``operator.getitem``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

__all__ = ["parse_table", "problems", "kernels_of", "targets_of"]

COMMUNICATION = ("_c10d_functional", "c10d_functional", "npu_define")
NOT_KERNELS = ("npugraph_ex",)  # events and stream scopes: the capture's own ordering
LIBRARY = "functional_npu"
LIBRARY_COLLECTIVES = ("broadcast_into",)
FORMAT_CASTS = re.compile(r"_?npu_format_cast(_)?(\..*)?$")
COMPOSITE_KEYS = ("CompositeImplicitAutograd", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")


def parse_table(text: str) -> dict[str, frozenset[str]]:
    """torch-npu's op table: ``{op name (with its overload, or bare for every overload): implementations}``, the
    implementations among ``op_api``, ``acl_op``, ``dvm`` (empty: torch-npu's own C++). Every section (``supported``,
    ``custom``, ``autograd``, ``quant``, ``symint``) is read; an op listed twice has the union."""
    table: dict[str, set[str]] = {}
    item: dict[str, str] | None = None

    def close() -> None:
        if item is None:
            return
        func = item.get("func") or item.get("")
        if not func:
            return
        name = func.split("(", 1)[0].strip()
        impls = {p.strip() for p in item.get("impl_ns", "").split(",") if p.strip()}
        if item.get("op_api", "").lower() == "true":
            impls.add("op_api")
        table.setdefault(name, set()).update(impls)

    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith((" ", "-")):  # a top-level key: a new section
            close()
            item = None
            continue
        if line.startswith("- "):
            close()
            item = {}
            line = "  " + line[2:]
        if item is None or not line.startswith("  ") or line.startswith("   "):
            continue  # nested (a dispatch map) or outside a list
        key, sep, value = line.strip().partition(":")
        if not sep:  # a bare name: "- _local_scalar_dense"
            item[""] = key
        else:
            item[key.strip()] = value.strip()
    close()
    return {name: frozenset(impls) for name, impls in table.items()}


def targets_of(graph_text: str) -> list[str]:
    """The ``call_function`` targets of a printed FX graph (a golden ``acl_graph.txt``), in order."""
    return [m.removeprefix("torch.ops.") for m in re.findall(r"call_function\[target=([^\]]+)\]", graph_text)]


def kernels_of(gm: torch.fx.GraphModule) -> list[str]:
    """The ``call_function`` targets of ``gm``, as :func:`targets_of` names them."""
    return [str(n.target).removeprefix("torch.ops.") for n in gm.graph.nodes if n.op == "call_function"]


def _lookup(table: Mapping[str, frozenset[str]], name: str, overload: str) -> frozenset[str] | None:
    for key in (f"{name}.{overload}", name if overload == "default" else None, name):
        if key is not None and key in table:
            return table[key]
    return None


def _is_view(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _composite(qualname: str) -> bool:
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key) for key in COMPOSITE_KEYS)


def _op(target: str) -> torch._ops.OpOverload | None:
    ns, name, overload = target.split(".", 2)
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError):
        return None


def _one(target: str, table: Mapping[str, frozenset[str]], npu_kernels: Mapping[str, str]) -> str | None:
    """Why ``target`` cannot run inside capture (None: it can)."""
    if target.startswith("_operator.") or target == "operator.getitem" or "." not in target:
        return None
    parts = target.split(".")
    ns = parts[0]
    if ns in COMMUNICATION or ns in NOT_KERNELS:
        return None
    if len(parts) != 3:
        return f"{target}: not an op this check knows"
    _, name, overload = parts
    if ns == LIBRARY:
        if name in LIBRARY_COLLECTIVES:
            return None
        qualname = f"{ns}::{name}"
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "PrivateUse1"):
            return (
                f"reference on the NPU: {target} has no NPU kernel (PrivateUse1): inside capture it would run its "
                f"reference implementation's ops"
            )
        vendor = npu_kernels.get(qualname)
        impls = None if vendor is None else _lookup(table, vendor, "default")
        if impls is None or "op_api" not in impls:
            listed = f"torch-npu's table lists as {impls}"
            return f"reference on the NPU: {target}'s NPU kernel calls {vendor!r}, which {listed}"
        return None
    impls = _lookup(table, name, overload)
    if FORMAT_CASTS.match(name):
        return (
            f"format cast: {target} inside capture (an aclop, Identity, on the released torch-npu): cast outside "
            f"the captured region, or keep the slot in the stored format"
        )
    if impls is not None:
        if impls and "op_api" not in impls:
            return (
                f"aclop: {target} is torch-npu's {', '.join(sorted(impls))} only: capture aborts on an aclop (107025)"
            )
        return None
    op = _op(target)
    if op is None:
        return f"no NPU kernel: {target} is in neither torch nor torch-npu's table"
    if _is_view(op) or _composite(op._schema.name):
        return None
    return f"no NPU kernel: {target} is not in torch-npu's table, and neither a view nor a composite of other ops"


def problems(targets: Iterable[str], table: Mapping[str, frozenset[str]], npu_kernels: Mapping[str, str]) -> list[str]:
    """One line per distinct op of a captured region (``targets``, as :func:`targets_of` names them) that ACL graph
    capture cannot take (module docstring). ``npu_kernels``: this library's custom ops (``ns::name``) -> the torch-npu
    op each one's NPU kernel calls (:data:`functional_npu.models.ascend_ops.NPU_KERNELS`)."""
    out = []
    for target in dict.fromkeys(targets):
        why = _one(target, table, npu_kernels)
        if why is not None:
            out.append(why)
    return out
