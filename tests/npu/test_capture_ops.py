"""Which ops ACL graph capture takes (functional_npu/npu/capture_ops.py), read from torch-npu's own op table in its
wheel: the table's reading against PyYAML's; planted ops that capture cannot take (an aclop, a format cast, an op
with no NPU kernel, this library's op running its reference, an NPU kernel calling an aclop) each refused by its
exact message; every golden ACL graph passes; and the quantized matmuls' NPU kernels, called against torch-npu's own
op schemas stood in on the CPU, give the CPU reference's result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from functional_npu.core import collectives  # noqa: F401 - defines functional_npu::broadcast_into
from functional_npu.models import ascend_ops
from functional_npu.models.ascend_ops import NPU_KERNELS
from functional_npu.npu import capture_ops
from tools.aten_graphs import CASES, read_artifact

from ..support import GRAPHS

ACL_CASES = [c for c in CASES if c.phase != "train"]


@pytest.fixture(scope="module")
def table_text():
    from functional_npu.npu import TorchairUnavailable
    from functional_npu.npu.wheel import op_table

    try:
        return op_table().read_text()
    except TorchairUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def table(table_text):
    return capture_ops.parse_table(table_text)


def test_the_table_reads_as_pyyaml_reads_it(table_text, table):
    yaml = pytest.importorskip("yaml")
    ref: dict[str, set[str]] = {}
    for entries in yaml.safe_load(table_text).values():
        for e in entries if isinstance(entries, list) else ():
            if isinstance(e, str):
                ref.setdefault(e, set())
                continue
            impls = {p.strip() for p in str(e.get("impl_ns", "")).split(",") if p.strip()}
            ref.setdefault(e["func"].split("(")[0].strip(), set()).update(
                impls | ({"op_api"} if e.get("op_api") else set())
            )
    assert {k: set(v) for k, v in table.items()} == ref and len(ref) > 1000
    assert table["mm"] == {"acl_op", "op_api", "dvm"} and table["npu_quant_matmul"] == {"op_api"}


@pytest.mark.parametrize(
    "target, message",
    [
        ("aten.lstm_cell.default", "aclop: aten.lstm_cell.default is torch-npu's acl_op only: capture aborts on an "
         "aclop (107025)"),
        ("npu.npu_format_cast.default", "format cast: npu.npu_format_cast.default inside capture (an aclop, "
         "Identity, on the released torch-npu): cast outside the captured region, or keep the slot in the stored "
         "format"),
        ("aten._int_mm.default", "no NPU kernel: aten._int_mm.default is not in torch-npu's table, and neither a view "
         "nor a composite of other ops"),
    ],
)  # fmt: skip
def test_an_op_capture_cannot_take_is_named(table, target, message):
    assert capture_ops.problems(["aten.mm.default", target, target], table, NPU_KERNELS) == [message]


def test_this_library_op_needs_an_npu_kernel_that_calls_an_aclnn_op(table):
    """``functional_npu::quant_matmul`` has its NPU kernel: allowed; pointed at an aclop-only torch-npu op it is
    refused; an op of the library with no NPU kernel (the reference only) is refused."""
    assert capture_ops.problems(["functional_npu.quant_matmul.default"], table, NPU_KERNELS) == []
    wrong = {"functional_npu::quant_matmul": "npu_bmmV2"}
    assert capture_ops.problems(["functional_npu.quant_matmul.default"], table, wrong) == [
        "reference on the NPU: functional_npu.quant_matmul.default's NPU kernel calls 'npu_bmmV2', which torch-npu's "
        "table lists as frozenset({'acl_op'})"
    ]
    lib = torch.library.Library("functional_npu", "FRAGMENT")
    lib.define("reference_only(Tensor x) -> Tensor")
    lib.impl("reference_only", lambda x: x * 2, "CompositeExplicitAutograd")
    assert capture_ops.problems(["functional_npu.reference_only.default"], table, NPU_KERNELS) == [
        "reference on the NPU: functional_npu.reference_only.default has no NPU kernel (PrivateUse1): inside capture "
        "it would run its reference implementation's ops"
    ]


def test_views_composites_collectives_and_events_need_no_table():
    targets = ["aten.view.default", "aten.reshape.default", "aten.ones.default", "_c10d_functional.all_reduce_.default",
               "npu_define.all_to_all_single_npu.default", "npugraph_ex.tagged_event_record.default",
               "functional_npu.broadcast_into.default", "operator.getitem"]  # fmt: skip
    assert capture_ops.problems(targets, {}, NPU_KERNELS) == []


@pytest.mark.parametrize("case", ACL_CASES, ids=lambda c: c.name)
def test_every_golden_acl_graph_holds_only_ops_capture_takes(case, table):
    assert read_artifact(GRAPHS, case.name, "acl_checks.json")["ops"] == []
    text = (Path(GRAPHS) / case.name / "acl_graph.txt").read_text()
    assert capture_ops.problems(capture_ops.targets_of(text), table, NPU_KERNELS) == []


def _standin(table_text: str) -> torch.library.Library:
    """torch-npu's two quantized matmuls on the CPU under their own schemas (from its table), computed as Ascend's
    kernels document them: ``(x1 @ x2) * scale * pertoken_scale`` in the output dtype numbered as torch's ScalarType;
    ``x @ ((w + antiquant_offset) * antiquant_scale)``, int4 unpacked from int32 words."""
    schemas = {
        line.split("func:", 1)[1].strip()
        for line in table_text.splitlines()
        if "func: npu_quant_matmul(" in line or "func: npu_weight_quant_batchmatmul(" in line
    }
    lib = torch.library.Library("npu", "FRAGMENT")
    for schema in sorted(schemas):
        lib.define(schema)
    dtypes = {v: k for k, v in ascend_ops.SCALAR_TYPE.items()}

    def quant(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, **_):
        acc = (x1.int() @ x2.int()).float() * scale * pertoken_scale[:, None]
        return acc.to(dtypes[output_dtype])

    def weight_quant(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None, quant_offset=None,
                     bias=None, antiquant_group_size=0, inner_precise=0, weight_dtype=None):  # fmt: skip
        w = ascend_ops.unpack_int4(weight) if weight.dtype == torch.int32 else weight
        scale, offset = antiquant_scale, antiquant_offset
        if antiquant_group_size:
            scale = scale.repeat_interleave(antiquant_group_size, 0)
            offset = None if offset is None else offset.repeat_interleave(antiquant_group_size, 0)
        w = w.to(scale.dtype) + (0 if offset is None else offset)
        return x @ (w * scale).to(x.dtype)

    lib.impl("npu_quant_matmul", quant, "CPU")
    lib.impl("npu_weight_quant_batchmatmul", weight_quant, "CPU")
    return lib


def test_the_npu_kernels_call_torch_npu_ops_under_their_own_schemas(table_text):
    lib = _standin(table_text)  # noqa: F841 - kept alive while the kernels run
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 8, (3, 32), dtype=torch.int8, generator=g)
    w = torch.randint(-8, 8, (32, 16), dtype=torch.int8, generator=g)
    scale, per = torch.rand(16, generator=g), torch.rand(3, generator=g)
    for dtype in (torch.bfloat16, torch.float16):
        got = ascend_ops.quant_matmul_npu(x, w, scale, per, dtype)
        assert torch.equal(got, ascend_ops.quant_matmul(x, w, scale, per, dtype)) and got.dtype == dtype
    a = torch.randn(3, 64, dtype=torch.bfloat16, generator=g)
    q = torch.randint(-8, 8, (64, 16), dtype=torch.int8, generator=g)
    for weight, group in ((q, 0), (ascend_ops.pack_int4(q), 32)):
        s = torch.rand((64 // group, 16) if group else (16,), generator=g).to(torch.bfloat16)
        o = torch.randn(s.shape, generator=g).to(torch.bfloat16)
        got = ascend_ops.weight_quant_matmul_npu(a, weight, s, o, group)
        assert torch.equal(got, ascend_ops.weight_quant_matmul(a, weight, s, o, group))
