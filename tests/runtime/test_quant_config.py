"""Reading a checkpoint's quantization from the config.json compressed-tensors writes, and refusing in one line
what is not supported."""

import json

import pytest

from functional_npu.core.quant import Quant
from functional_npu.runtime.quant_config import read_quant_config


def _written(tmp_path, weights, activations=None, fmt=None, ignore=("lm_head", "re:.*mlp\\.gate$"), **extra):
    """config.json as compressed-tensors' ModelCompressor.update_config writes it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**weights),
        input_activations=QuantizationArgs(**activations) if activations else None,
        format=fmt,
    )
    cfg = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=list(ignore), format=fmt, quantization_status="compressed", **extra
    )
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    ModelCompressor(quantization_config=cfg).update_config(str(tmp_path))
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize(
    "weights, activations, fmt, want",
    [
        (
            dict(num_bits=8, strategy="channel"),
            dict(num_bits=8, strategy="token", dynamic=True),
            "int-quantized",
            Quant(8, "channel", activations="token"),
        ),
        (dict(num_bits=8, strategy="channel"), None, "pack-quantized", Quant(8, "channel", packed=True)),
        (dict(num_bits=4, strategy="group", group_size=128), None, "pack-quantized", Quant(4, "group", group_size=128)),
        (
            dict(num_bits=4, strategy="group", group_size=32, symmetric=False),
            None,
            "pack-quantized",
            Quant(4, "group", group_size=32, symmetric=False),
        ),
        (
            dict(num_bits=8, strategy="block", block_structure=[128, 128]),
            None,
            "int-quantized",
            Quant(8, "block", block=(128, 128)),
        ),
        (dict(num_bits=8, strategy="tensor"), None, "naive-quantized", Quant(8, "tensor")),
    ],
)
def test_schemes_as_compressed_tensors_writes_them(tmp_path, weights, activations, fmt, want):
    got = read_quant_config(_written(tmp_path, weights, activations, fmt))
    assert got.quant == want and got.format == fmt
    assert got.applies_to("model.layers.0.self_attn.q_proj")
    assert got.applies_to("model.layers.3.mlp.experts.7.down_proj")
    assert not got.applies_to("lm_head") and not got.applies_to("model.layers.0.mlp.gate")  # the MoE router


def test_no_quantization_config_is_a_float_checkpoint():
    assert read_quant_config({"architectures": ["LlamaForCausalLM"]}) is None


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q: q | {"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
        (lambda q: _weights(q, type="float", num_bits=8), "type 'float' \\(float weights such as fp8"),
        (lambda q: _weights(q, actorder="group"), "actorder 'group' \\(activation reordering\\)"),
        (lambda q: _weights(q, num_bits=2), "num_bits 2 is not supported"),
        (lambda q: _group(q, format="float-quantized"), "format 'float-quantized' is not supported"),
        (
            lambda q: _group(q, input_activations={"num_bits": 8, "strategy": "tensor", "dynamic": False}),
            "only dynamic per-token int8",
        ),
        (lambda q: q | {"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
        (
            lambda q: q | {"config_groups": q["config_groups"] | {"group_1": q["config_groups"]["group_0"]}},
            "2 config_groups",
        ),
        (lambda q: q | {"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
        (lambda q: _weights(q, strategy="group", group_size=None), "needs a positive int group_size"),
    ],
)
def test_unsupported_schemes_are_refused_in_one_line(tmp_path, change, message):
    hf = _written(tmp_path, dict(num_bits=4, strategy="group", group_size=32), fmt="pack-quantized")
    bad = hf | {"quantization_config": change(dict(hf["quantization_config"]))}
    with pytest.raises(ValueError, match=message) as e:
        read_quant_config(bad)
    assert "\n" not in str(e.value) and "supported: compressed-tensors" in str(e.value)


def _group(q, **fields):
    group = dict(q["config_groups"]["group_0"]) | fields
    return q | {"config_groups": {"group_0": group}}


def _weights(q, **fields):
    return _group(q, weights=dict(q["config_groups"]["group_0"]["weights"]) | fields)
