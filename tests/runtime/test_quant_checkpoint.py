"""Quantized checkpoints: what ``save_checkpoint(quant=...)`` writes is what compressed-tensors writes, bit for
bit, and what ``load_checkpoint`` refuses, before reading a byte: schemes it does not run, tensors whose shape
or type disagree with the config, fused leaves quantized in part, shards that would cut a group, bad dtypes."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from functional_npu import Mesh, Quant
from functional_npu.placement.quant_config import read_quant_config
from functional_npu.runtime.loading.checkpoint import load_checkpoint
from functional_npu.runtime.loading.save import save_checkpoint

from ..support.ct_models import SCHEMES, quantize_checkpoint
from ..support.hf_models import save_tiny

OURS = {
    "w8a8": Quant(8, "channel", activations="token"),
    "w8a16": Quant(8, "channel", packed=True),
    "w4a16": Quant(4, "group", group_size=32),
    "w4a16_asym": Quant(4, "group", group_size=32, symmetric=False),
}
ONE = Mesh.abstract({"tp": 1}, 0)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("float")
    save_tiny("qwen3", path, 5, intermediate_size=128)
    return path


@pytest.fixture(scope="module")
def int4_dir(float_dir, tmp_path_factory):
    return save_checkpoint(load_checkpoint(float_dir, ONE), tmp_path_factory.mktemp("int4"), quant=OURS["w4a16"])


def _edit(src, dst, tensors=None, config=None):
    """A copy of the checkpoint ``src`` with some tensors and config.json changed."""
    dst.mkdir()
    state = load_file(src / "model.safetensors")
    save_file(tensors(state) if tensors else state, str(dst / "model.safetensors"))
    hf = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(hf) if config else hf))
    return dst


def _load_refused(path, **kw):
    read = []
    with pytest.raises((ValueError, TypeError)) as e:
        load_checkpoint(path, kw.pop("mesh", ONE), on_read=lambda name, n: read.append(name), **kw)
    assert read == [], f"bytes were read before the error: {read[:3]}"
    return str(e.value)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_written_as_compressed_tensors_writes_it(float_dir, tmp_path, scheme):
    from compressed_tensors.quantization import QuantizationConfig

    ours = save_checkpoint(load_checkpoint(float_dir, ONE), tmp_path / "ours", quant=OURS[scheme])
    theirs = quantize_checkpoint(float_dir, tmp_path / "theirs", scheme, ignore=["lm_head"])
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name in b:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    qa, qb = (json.loads((d / "config.json").read_text())["quantization_config"] for d in (ours, theirs))
    assert read_quant_config({"quantization_config": qa}) == read_quant_config({"quantization_config": qb})
    QuantizationConfig.model_validate(qa)  # compressed-tensors reads ours


def test_a_scale_of_the_wrong_shape_is_named_before_reading(int4_dir, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight_scale"
    bad = _edit(int4_dir, tmp_path / "bad", lambda s: s | {name: s[name][:, :2].contiguous()})
    msg = _load_refused(bad)
    assert name in msg and "layers.1.down.weight_scale" in msg and "(64, 2)" in msg and "(64, 4)" in msg
    assert "Quant(int4, group 32)" in msg


def test_packed_weights_of_the_wrong_type_are_named(int4_dir, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight_packed"
    bad = _edit(int4_dir, tmp_path / "bad", lambda s: s | {name: s[name].to(torch.int64)})
    msg = _load_refused(bad)
    assert name in msg and "I64" in msg and "torch.int32" in msg


def test_missing_zero_points_are_listed(float_dir, tmp_path):
    asym = save_checkpoint(load_checkpoint(float_dir, ONE), tmp_path / "asym", quant=OURS["w4a16_asym"])
    gone = "model.layers.0.mlp.up_proj.weight_zero_point"
    msg = _load_refused(_edit(asym, tmp_path / "bad", lambda s: {k: v for k, v in s.items() if k != gone}))
    assert "missing tensors (1)" in msg and gone in msg


def test_a_fused_leaf_quantized_in_part_is_refused(int4_dir, tmp_path):
    def ignore_k(hf):
        hf["quantization_config"]["ignore"].append("re:.*k_proj$")
        return hf

    msg = _load_refused(_edit(int4_dir, tmp_path / "bad", config=ignore_k))
    assert "layers.0.qkv" in msg and "k_proj" in msg and "quantized whole or not at all" in msg


def test_a_shard_that_would_cut_a_group_is_named(tmp_path):
    save_tiny("qwen3", tmp_path / "f", 5)  # intermediate 96: 3 groups of 32 in down_proj's input
    q = save_checkpoint(load_checkpoint(tmp_path / "f", ONE), tmp_path / "q", quant=OURS["w4a16"])
    msg = _load_refused(q, mesh=Mesh.abstract({"tp": 2}, 0))
    assert "layers.0.down.weight_scale" in msg and "3 groups of 32" in msg and "'tp' (size 2)" in msg
    assert "group size" in msg


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda w: w | {"type": "float"}, "type 'float'"),
        (lambda w: w | {"actorder": "group"}, "actorder 'group'"),
        (lambda w: w | {"num_bits": 3}, "num_bits 3"),
    ],
    ids=["fp8", "activation-reordering", "int3"],
)
def test_unsupported_schemes_are_refused_at_load(int4_dir, tmp_path, edit, named):
    def change(hf):
        group = hf["quantization_config"]["config_groups"]["group_0"]
        group["weights"] = edit(group["weights"])
        return hf

    msg = _load_refused(_edit(int4_dir, tmp_path / "bad", config=change))
    assert named in msg and "is not supported; supported:" in msg and "\n" not in msg


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, "bfloat16", int])
def test_dtype_must_be_a_floating_torch_dtype(int4_dir, dtype):
    msg = _load_refused(int4_dir, dtype=dtype)
    assert "dtype must be" in msg and ("torch.bfloat16" in msg or "floating-point" in msg)


def test_scales_take_the_requested_dtype_and_integers_keep_theirs(int4_dir):
    params = load_checkpoint(int4_dir, ONE, dtype=torch.bfloat16)
    qkv = params["layers"][0]["qkv"]
    assert qkv["weight_packed"].dtype == torch.int32 and qkv["weight_scale"].dtype == torch.bfloat16
    assert params["embed"].dtype == torch.bfloat16
