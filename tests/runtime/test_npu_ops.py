"""NPU convertibility without an NPU: captured model ops against torchair's working GE converters
(extracted from the torch-npu 2.13.0 wheel by tools/extract_torchair_ops.py)."""

import json

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


def test_captured_model_ops_are_convertible():
    supported = set(OPS["converters"]) | set(OPS["decompositions"]) | set(CONVERTED)  # CONVERTED: this library's
    outside = {}
    for census in sorted(GRAPHS.glob("*/census.json")):
        for op in json.loads(census.read_text()):
            if not op.startswith("<") and op not in supported:  # '<built-in function getitem>' is graph plumbing
                outside.setdefault(op, []).append(census.parent.name)
    assert outside == {}, f"ops without a working torchair converter: {outside}"
