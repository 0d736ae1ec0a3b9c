"""A linear layer's matmul by its weight's form: the CPU kernels against the dequantized weight, eager and
compiled whole."""

import pytest
import torch

from functional_npu.core.quant import Quant, dequantize, quantize
from functional_npu.models.linear import kernel_of, linear, prepare

CASES = [
    (Quant(8, "channel"), "w8"),
    (Quant(8, "channel", packed=True), "w8"),
    (Quant(8, "channel", activations="token"), "w8a8"),
    (Quant(4, "group", group_size=32), "w4"),
    (Quant(4, "group", group_size=128, symmetric=False), "w4"),
    (Quant(4, "channel", symmetric=False), "w4"),
    (Quant(4, "group", group_size=16), "dense"),  # a group size the int4 kernel does not take
    (Quant(8, "block", block=(32, 64)), "dense"),  # no int8 kernel with block scales
]


@pytest.mark.parametrize("quant, kind", CASES, ids=[repr(q) for q, _ in CASES])
def test_kernels_match_the_dequantized_weight(quant, kind):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 256, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(3, 5, 256, generator=g).to(torch.bfloat16)
    stored = quantize(w, quant)
    prepared = prepare(stored, quant, torch.bfloat16)
    assert kernel_of(prepared) == kind
    want = x.float() @ dequantize(stored, quant).float().T
    if quant.activations == "token":  # the activations are quantized too: compare with them quantized alike
        xs = x.float().abs().amax(-1, keepdim=True) / 127.5
        want = (torch.round(x.float() / xs).clamp(-128, 127) * xs) @ dequantize(stored, quant).float().T
    got = linear(x, prepared)
    assert got.shape == (3, 5, 96) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.02, rtol=0.02)
    compiled = torch.compile(linear, fullgraph=True, dynamic=False)(x, prepared)
    torch.testing.assert_close(compiled.float(), want, atol=0.02, rtol=0.02)


def test_a_stored_quantized_weight_must_be_prepared():
    stored = quantize(torch.randn(16, 32), Quant(8, "channel"))
    with pytest.raises(TypeError, match="go through functional_npu.models.linear.prepare first"):
        linear(torch.randn(2, 32), stored)


def test_one_bf16_row_compiled_is_a_fused_reduction():
    """Under torch.compile one row of bf16 weights on a CPU is a multiply-and-sum (no matmul in the graph), as
    exact as the matmul: fp32 accumulation, one rounding to bf16."""
    from functional_npu.models.linear import linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g).bfloat16()
    x = torch.randn(1, 1, 128, generator=g).bfloat16()
    targets = []

    def backend(gm, inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes)
        return gm

    torch._dynamo.reset()
    y = torch.compile(linear, backend=backend, fullgraph=True)(x, w)
    assert targets and not any("matmul" in t or "linear" in t for t in targets), targets
    want = (x.float() @ w.float().T).bfloat16()
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    assert torch.equal(linear(x, w), x @ w.T)  # eager: the matmul
