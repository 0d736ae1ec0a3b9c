"""A linear layer's matmul by its weight's form: the CPU kernels and the Ascend kernels' references against
the dequantized weight, eager and compiled whole."""

import pytest
import torch

from functional_npu.core.quant import Quant, dequantize, quantize
from functional_npu.models.ascend_ops import pack_int4, unpack_int4
from functional_npu.models.linear import kernel_of, linear, prepare

CASES = [  # (scheme, the form for CPU kernels, the form for Ascend's)
    (Quant(8, "channel"), "w8", "wqbmm"),
    (Quant(8, "channel", packed=True), "w8", "wqbmm"),
    (Quant(8, "tensor"), "w8", "wqbmm"),
    (Quant(8, "channel", activations="token"), "w8a8", "qbmm"),
    (Quant(4, "group", group_size=32), "w4", "wqbmm"),
    (Quant(4, "group", group_size=128, symmetric=False), "w4", "wqbmm"),
    (Quant(4, "channel", symmetric=False), "w4", "wqbmm"),
    (Quant(8, "group", group_size=64, symmetric=False), "dense", "wqbmm"),
    (Quant(4, "group", group_size=16), "dense", "dense"),  # a group size neither kernel takes
    (Quant(8, "block", block=(32, 64)), "dense", "wqbmm"),  # Ascend: a block's scale is a group scale per row
    (Quant(8, "group", group_size=64, activations="token"), "a8", "a8"),  # int8 activations: kernels per channel only
    (Quant(4, "group", group_size=16, activations="token"), "a8", "a8"),
]


@pytest.mark.parametrize("target", ["cpu", "npu"])
@pytest.mark.parametrize("quant, cpu, npu", CASES, ids=[repr(q) for q, *_ in CASES])
def test_kernels_match_the_dequantized_weight(quant, cpu, npu, target):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 256, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(3, 5, 256, generator=g).to(torch.bfloat16)
    stored = quantize(w, quant)
    prepared = prepare(stored, quant, torch.bfloat16, target=target)
    assert kernel_of(prepared) == (cpu if target == "cpu" else npu)
    want = x.float() @ dequantize(stored, quant).float().T
    if quant.activations == "token":  # the activations are quantized too: compare with them quantized alike
        xs = x.float().abs().amax(-1, keepdim=True) / 127.5
        want = (torch.round(x.float() / xs).clamp(-128, 127) * xs) @ dequantize(stored, quant).float().T
    got = linear(x, prepared)
    assert got.shape == (3, 5, 96) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.02, rtol=0.02)
    torch._dynamo.reset()  # a fresh graph per form (22 forms would pass dynamo's recompile limit)
    compiled = torch.compile(linear, fullgraph=True, dynamic=False)(x, prepared)
    torch.testing.assert_close(compiled.float(), want, atol=0.02, rtol=0.02)


def test_ascend_forms_are_input_major_and_need_16_bit_activations():
    stored = quantize(torch.randn(96, 256) * 0.05, Quant(4, "group", group_size=32, symmetric=False))
    w = prepare(stored, Quant(4, "group", group_size=32, symmetric=False), torch.float16, target="npu")
    assert w["wqbmm"].shape == (256, 96 // 8) and w["wqbmm"].dtype == torch.int32
    assert w["scale"].shape == w["offset"].shape == (256 // 32, 96) and w["scale"].dtype == torch.float16
    w8a8 = prepare(
        quantize(torch.randn(96, 256), Quant(8, "channel", activations="token")),
        Quant(8, "channel", activations="token"),
        torch.bfloat16,
        target="npu",
    )
    assert w8a8["qbmm"].shape == (256, 96) and w8a8["scale"].shape == (96,) and w8a8["scale"].dtype == torch.float32
    # QuantBatchMatmulV3 / WeightQuantBatchMatmulV2 take no float32 activations: dequantized instead
    assert (
        kernel_of(prepare(stored, Quant(4, "group", group_size=32, symmetric=False), torch.float32, target="npu"))
        == "dense"
    )
    with pytest.raises(ValueError, match="target 'gpu' is not one of"):
        prepare(stored, Quant(4, "group", group_size=32, symmetric=False), torch.bfloat16, target="gpu")


def test_ascend_int4_packing_is_twos_complement_low_nibble_first():
    q = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [-1] * 8, [-8, 7, -8, 7, -8, 7, -8, 7]], dtype=torch.int8)
    words = pack_int4(q)
    assert words.dtype == torch.int32 and words.shape == (3, 1)
    assert [w & 0xFFFFFFFF for w in words.reshape(-1).tolist()] == [0x76543210, 0xFFFFFFFF, 0x78787878]
    r = torch.randint(-8, 8, (5, 64), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(r)), r)


def test_a_stored_quantized_weight_must_be_prepared():
    stored = quantize(torch.randn(16, 32), Quant(8, "channel"))
    with pytest.raises(TypeError, match="go through functional_npu.models.linear.prepare first"):
        linear(torch.randn(2, 32), stored)


@pytest.mark.parametrize("form", ["float32", "bfloat16"])
def test_streamed_forms_compiled_are_reductions_for_a_few_rows(form):
    """Under torch.compile a few rows of a ``streamed`` form (up to 8 in float32, one in bf16) are one multiply-and-sum
    per row over the weight (no matmul in the graph), as exact as the matmul (fp32 accumulation, one rounding); more
    rows, eager, and the plain form (what a layer-sharded weight arrives as) take the matmul. Small integers: every
    product and sum is exact, so any order gives the same bits."""
    from functional_npu.models.linear import linear, prepare_dense, stream_rows

    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if form == "float32" else torch.bfloat16
    values = torch.randint(-3, 4, (64, 128), generator=g)
    plain = values.to(dtype)
    held = prepare_dense(plain)
    dense = values.float()

    def graph_targets(x, w):
        targets = []

        def backend(gm, inputs):
            targets.extend(str(n.target) for n in gm.graph.nodes)
            return gm

        torch._dynamo.reset()
        y = torch.compile(linear, backend=backend, fullgraph=True)(x, w)
        assert y.dtype == dtype and torch.equal(y, (x.float() @ dense.T).to(dtype))
        return targets

    kernels = ("mm", "matmul", "linear", "int8pack")
    rows = stream_rows(dtype)
    assert rows == (8 if form == "float32" else 1)
    for shape in [(1, 1, 128), (rows, 128), (2, rows // 2, 128)] if rows > 1 else [(1, 1, 128)]:
        x = torch.randint(-3, 4, shape, generator=g).to(dtype)
        targets = graph_targets(x, held)
        assert targets and not any(k in t for t in targets for k in kernels), (shape, targets)
    assert any(k in t for t in graph_targets(x, plain) for k in kernels)  # the plain form: the matmul
    more = torch.randint(-3, 4, (rows + 1, 128), generator=g).to(dtype)
    assert any(k in t for t in graph_targets(more, held) for k in kernels)  # past the rows: the matmul
    x = torch.ones(1, 128, dtype=dtype)
    assert torch.equal(linear(x, held), (x.float() @ dense.T).to(dtype))  # eager: the matmul or the int8 kernel


def test_dense_linears_are_held_row_major_on_the_cpu():
    """A few rows stream each weight row in one run: a weight that arrives transposed is copied row-major once;
    layer-sharded leaves keep their plain form (they arrive by broadcast: the matmul)."""
    from functional_npu.models.linear import dense, prepare_dense, prepare_params

    g = torch.Generator().manual_seed(0)
    w = torch.randint(-3, 4, (96, 256), generator=g).float()
    held = prepare_dense(w.T.contiguous().T)["streamed"]  # the same [out, in] values, input-major
    assert held.shape == w.shape and torch.equal(held, w) and held.is_contiguous()
    assert prepare_dense(w)["streamed"] is w and dense(prepare_dense(w)) is w and dense(w) is w
    column = w.T.contiguous().T
    assert prepare_dense(column, "npu") is column and prepare_dense(torch.randn(4, 96, 256)).is_contiguous()
    x = torch.randint(-3, 4, (2, 3, 256), generator=g).float()
    assert torch.equal(linear(x, prepare_dense(column)), x @ w.T)
    w = column
    params = {"embed": torch.randn(8, 256), "lm_head": w, "layers": [{"down": w, "norm": torch.ones(256)}]}
    params["series"] = {"down": w[None]}  # layer-sharded leaves are broadcast as stored
    out = prepare_params(params, target="cpu", linears=("down", "lm_head"))
    assert out["lm_head"]["streamed"].is_contiguous() and out["layers"][0]["down"]["streamed"].is_contiguous()
    assert out["series"]["down"] is params["series"]["down"] and out["embed"] is params["embed"]
    assert out["layers"][0]["norm"] is params["layers"][0]["norm"]
    assert params["lm_head"] is w and not w.is_contiguous()  # pure
