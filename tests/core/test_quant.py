"""Quantized weights as layouts: the reference quantization is compressed-tensors' bit for bit, and sharding a
quantized weight equals quantizing the shard, for every scheme whose scales are local to a shard."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu import Block, Mesh, fused, sharded
from functional_npu.core.layout import LayoutError
from functional_npu.core.quant import Quant, dequantize, pack_int32, quant_layouts, quant_shapes, quantize, unpack_int32
from functional_npu.core.shard import shard

from ..support.ct_models import weight_qparams

SCHEMES = [
    Quant(8, "channel"),
    Quant(8, "channel", packed=True),  # weight-only int8, as compressed-tensors' pack-quantized writes it
    Quant(4, "group", group_size=32),
    Quant(4, "group", group_size=32, symmetric=False),
    Quant(4, "channel", symmetric=False),
    Quant(8, "tensor"),
    Quant(8, "block", block=(32, 64)),
    Quant(4, "block", block=(32, 64)),
]


def _compressed_tensors(w: torch.Tensor, quant: Quant) -> dict[str, torch.Tensor]:
    """What compressed-tensors stores for ``w``: its observer statistics, its qparams, its compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(
        num_bits=quant.bits,
        strategy=quant.strategy,
        group_size=quant.group_size,
        block_structure=list(quant.block) if quant.block else None,
        symmetric=quant.symmetric,
    )
    scale, zero = weight_qparams(w, args)
    fmt = "pack-quantized" if quant.packed else "int-quantized"
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format=fmt)
    stored = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero}
    return BaseCompressor.get_value_from_registry(fmt).compress(stored, scheme)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("quant", SCHEMES, ids=repr)
def test_quantize_is_compressed_tensors_bit_for_bit(quant, dtype):
    w = (torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    ref = _compressed_tensors(w, quant)
    ours = quantize(w, quant)
    assert set(ours) == {k for k in ref if k != "weight_shape"}
    for name, want in ref.items():
        if name == "weight_shape":
            assert want.tolist() == list(w.shape)
            continue
        got = ours[name]
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_eight_bit_weights_packed_four_to_a_word_as_compressed_tensors_writes_them_for_weight_only():
    """compressed-tensors' pack-quantized format stores 8-bit weight-only checkpoints as int32 words."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-128, 128, (16, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(pack_int32(q, 8), pack_to_int32(q, 8))
    assert torch.equal(unpack_int32(pack_int32(q, 8), 8), q)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([4, 8]), st.integers(1, 3), st.integers(1, 4), st.sampled_from([-1, -2]), st.data())
def test_pack_unpack_round_trip(bits, rows, words, dim, data):
    per = 32 // bits
    shape = (rows, words * per) if dim == -1 else (words * per, rows)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    seed = data.draw(st.integers(0, 2**16))
    q = torch.randint(lo, hi + 1, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    packed = pack_int32(q, bits, dim)
    assert packed.dtype == torch.int32 and packed.shape[dim] == words
    assert torch.equal(unpack_int32(packed, bits, dim), q)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(SCHEMES), st.data())
def test_dequantized_weight_is_within_half_a_step(quant, data):
    """Every value comes back within half its scale (the largest scale bounds them all; a value packed into the
    wrong place would miss by the weight's range)."""
    seed = data.draw(st.integers(0, 2**16))
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(seed)) * 0.05
    stored = quantize(w, quant)
    err = (dequantize(stored, quant) - w).abs().max()
    assert err <= stored["weight_scale"].max() / 2 * (1 + 1e-3)  # the top value clamps: exactly half a step
    assert err < w.abs().max() / 4


# ---- sharding a quantized tree equals quantizing the sharded tree ---------------------------------------------
@st.composite
def linear_case(draw):
    """A float weight, its tensor-parallel layout (column-parallel with fused blocks, or row-parallel), a mesh
    and a scheme whose scales are local to each shard (channel scales with sharded rows; group and block scales
    either way), sized so every shard holds whole groups, blocks and packed words."""
    n = draw(st.sampled_from([1, 2, 4]))
    quant = draw(
        st.sampled_from(
            [
                Quant(8, "channel"),
                Quant(4, "channel", symmetric=False),
                Quant(4, "group", group_size=8),
                Quant(4, "group", group_size=16, symmetric=False),
                Quant(8, "block", block=(8, 16)),
                Quant(4, "block", block=(8, 8)),
            ]
        )
    )
    row = 8 * (quant.block[0] if quant.block else 1)  # rows per unit: whole packed zero points and scale blocks
    col = 16 * (quant.block[1] if quant.block else 1)  # columns per unit: whole packed words and groups
    # a channel's scale spans the whole row: local to a shard only when the rows are what is sharded
    if quant.strategy == "channel" or draw(st.booleans()):  # column-parallel over fused blocks, e.g. [q|k|v]
        sizes = [n * row * draw(st.integers(1, 2)) for _ in range(draw(st.integers(1, 3)))]
        layout = fused(0, [Block(f"b{i}", s, row) for i, s in enumerate(sizes)], "tp")
        shape = (sum(sizes), col * draw(st.integers(1, 2)))
    else:  # row-parallel
        layout = sharded(1, "tp")
        shape = (row * draw(st.integers(1, 2)), n * col * draw(st.integers(1, 2)))
    seed = draw(st.integers(0, 2**16))
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05
    return w, layout, Mesh.abstract({"tp": n}), quant


@settings(max_examples=60, deadline=None)
@given(linear_case())
def test_sharding_a_quantized_weight_equals_quantizing_its_shard(case):
    w, layout, mesh, quant = case
    stored = quantize(w, quant)
    layouts = quant_layouts(layout, quant)
    assert set(layouts) == set(stored)
    for c in range(mesh.axis_size("tp")):
        local = shard(stored, layouts, mesh, coordinate={"tp": c})
        want = quantize(shard(w, layout, mesh, coordinate={"tp": c}), quant)
        for name in stored:
            assert torch.equal(local[name], want[name]), (name, c, layouts[name])


def test_per_tensor_scales_one_per_fused_block_are_replicated():
    """[q|k|v] with a scale per logical matrix: every shard holds all three (each of its rows needs one)."""
    blocks = [Block("q", 64, 16), Block("k", 32, 16), Block("v", 32, 16)]
    w = torch.randn(128, 32, generator=torch.Generator().manual_seed(0))
    quant = Quant(8, "tensor")
    stored = quantize(w, quant, blocks=blocks)
    assert stored["weight_scale"].shape == (3,)
    for name, part in zip("qkv", w.split([64, 32, 32])):
        assert torch.equal(
            quantize(part, quant)["weight_scale"], stored["weight_scale"][["q", "k", "v"].index(name)][None]
        )
    layouts = quant_layouts(fused(0, blocks, "tp"), quant)
    assert layouts["weight_scale"].is_replicated
    local = shard(stored, layouts, Mesh.abstract({"tp": 2}), coordinate={"tp": 1})
    assert torch.equal(local["weight_scale"], stored["weight_scale"])
    per_block = [quantize(part, quant) for part in w.split([64, 32, 32])]
    assert torch.equal(dequantize(stored, quant, blocks=blocks), torch.cat([dequantize(p, quant) for p in per_block]))


def test_stacked_leading_dims_keep_their_layout():
    """Experts or stacked layers ([E, out, in], dim 0 sharded over ep): the scales share the leading dims."""
    layouts = quant_layouts(sharded(0, "ep").with_dim(2, sharded(0, "tp").dims[0]), Quant(4, "group", group_size=32), 3)
    assert layouts["weight_scale"].dims[0] == layouts["weight_packed"].dims[0] == sharded(0, "ep").dims[0]
    assert layouts["weight_scale"].dims[2].group_size == 32 and layouts["weight_packed"].dims[2].pack == 8


# ---- bad input ------------------------------------------------------------------------------------------------
def test_a_group_cut_by_a_shard_is_named():
    quant = Quant(4, "group", group_size=128)
    shapes = quant_shapes((64, 384), quant)  # 3 groups of 128 along in
    layouts = quant_layouts(sharded(1, "tp"), quant)
    stored = {
        k: torch.zeros(s, dtype=torch.int32 if k == "weight_packed" else torch.float32) for k, s in shapes.items()
    }
    with pytest.raises(LayoutError) as e:
        shard(stored, layouts, Mesh.abstract({"tp": 2}), coordinate={"tp": 0})
    msg = str(e.value)
    assert "3 groups of 128" in msg and "'tp' (size 2)" in msg and "weight_scale" in msg and "group size" in msg


def test_a_packed_word_cut_by_a_fused_block_shard_is_named():
    quant = Quant(4, "group", group_size=8, symmetric=False)  # zero points packed eight rows to a word
    blocks = [Block("q", 16, 4), Block("k", 8, 4, True), Block("v", 8, 4, True)]
    layouts = quant_layouts(fused(0, blocks, "tp"), quant)
    zp = torch.zeros(4, 4, dtype=torch.int32)  # 32 rows / 8, 32 columns / 8
    with pytest.raises(LayoutError, match=r"block 'q'.*stored-element boundary \(pack 8\).*multiples of 8"):
        shard(
            {"weight_zero_point": zp},
            {"weight_zero_point": layouts["weight_zero_point"]},
            Mesh.abstract({"tp": 4}),
            coordinate={"tp": 0},
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bits": 3}, "bits must be 4 or 8"),
        ({"strategy": "row"}, "strategy must be one of"),
        ({"strategy": "group"}, "needs a positive int group_size"),
        ({"strategy": "channel", "group_size": 32}, "is for strategy 'group'"),
        ({"strategy": "block", "block": (128,)}, "needs block=\\(rows, cols\\)"),
        ({"strategy": "tensor", "symmetric": False}, "zero points"),
        ({"activations": "tensor"}, "activations must be None or 'token'"),
        ({"bits": 4, "packed": False}, "4-bit weights are stored packed"),
    ],
)
def test_bad_schemes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Quant(**kwargs)


def test_shapes_that_a_scheme_does_not_divide():
    with pytest.raises(ValueError, match=r"shape \(64, 104\): the group size along in 32 does not divide 104"):
        quant_shapes((64, 104), Quant(4, "group", group_size=32))
    with pytest.raises(ValueError, match=r"the pack factor \(int4 values per int32\) along in 8 does not divide 12"):
        quant_shapes((64, 12), Quant(4, "channel"))
