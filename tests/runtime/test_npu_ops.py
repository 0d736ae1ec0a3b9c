"""NPU convertibility without an NPU: captured model ops against torchair's working GE converters
(extracted from the torch-npu 2.13.0 wheel by tools/extract_torchair_ops.py)."""

import ast
import json
from pathlib import Path

import functional_npu.runtime.serving as serving
from functional_npu.models.ascend_ops import CONVERTED

from ..support import GRAPHS, torchair_ops

OPS = torchair_ops()


def test_extracted_list_is_sane():
    conv, stubs, decomp = set(OPS["converters"]), set(OPS["stubs"]), set(OPS["decompositions"])
    assert OPS["wheel"].startswith("torch_npu-2.13.0")
    assert "aten.mm.default" in conv and "aten.mm.out" in stubs  # a real converter and a NotImplementedError stub
    assert not conv & stubs
    assert "_c10d_functional.all_to_all_single.default" in decomp
    for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "wait_tensor"):
        assert f"_c10d_functional.{op}.default" in conv


def _aten_converted_here() -> set[str]:
    """The aten ops this library registers GE converters for (``ge_converters.py``, read as source: it imports only
    where torchair does), as ``aten.op.overload``."""
    tree = ast.parse((Path(serving.__file__).parent / "ge_converters.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_fx_node_ge_converter":
            name = ast.unparse(node.args[0])
            if name.startswith("torch.ops.aten."):
                out.add(name.removeprefix("torch.ops."))
    return out


def test_the_library_converts_the_paged_write_torchair_does_not():
    assert {"aten.index_put.default", "aten.index_put_.default"} <= _aten_converted_here()
    assert "aten.index_put.default" in OPS["stubs"]  # torchair's own raises NotImplementedError


def test_captured_model_ops_are_convertible():
    supported = set(OPS["converters"]) | set(OPS["decompositions"]) | set(CONVERTED)  # CONVERTED: this library's
    supported |= _aten_converted_here()
    outside = {}
    for census in sorted(GRAPHS.glob("*/census.json")):
        for op in json.loads(census.read_text()):
            if not op.startswith("<") and op not in supported:  # '<built-in function getitem>' is graph plumbing
                outside.setdefault(op, []).append(census.parent.name)
    assert outside == {}, f"ops without a working torchair converter: {outside}"
