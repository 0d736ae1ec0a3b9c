"""Reading a checkpoint's quantization from the config.json compressed-tensors writes, and refusing in one line
what is not supported."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from functional_npu.core.quant import Quant
from functional_npu.placement.quant_config import QuantConfig, read_quant_config


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
        (lambda q: _weights(q, strategy="group", group_size=0), "needs a positive int group_size"),
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


@pytest.mark.parametrize("preset", ["W8A16", "W4A16", "W4A16_ASYM", "W4A8", "W8A8", "INT8", "FP8", "NVFP4", "W2A16"])
def test_a_preset_reads_as_compressed_tensors_expands_it_or_is_refused_by_name(preset):
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"]).model_dump(mode="json")
    w4 = (scheme.get("weights") or {}).get("num_bits") == 4
    fmt = "int-quantized" if scheme.get("input_activations") and not w4 else "pack-quantized"

    def config(group):
        return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt, "config_groups": group}}

    try:
        want = read_quant_config(config({"group_0": scheme}))
    except ValueError:
        with pytest.raises(ValueError, match=rf"preset scheme '{preset}'; that preset is not supported here") as e:
            read_quant_config(config({preset: ["Linear"]}))
        assert "\n" not in str(e.value)
        return
    assert read_quant_config(config({preset: ["Linear"]})) == want
    assert read_quant_config(config({preset.lower(): ["Linear"]})) == want  # compressed-tensors upper-cases the name


def test_every_supported_preset_is_compressed_tensors_own():
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    from functional_npu.placement.quant_config import PRESETS

    for name, scheme in PRESETS.items():
        theirs = {k: v.model_dump(mode="json", exclude_none=True) for k, v in PRESET_SCHEMES[name].items()}
        assert {k: {f: x for f, x in v.items() if f in theirs[k]} for k, v in scheme.items()} == theirs, name


_VALID = [
    QuantConfig.of(q).to_hf()
    for q in (
        Quant(4, "group", group_size=32),
        Quant(4, "group", group_size=32, symmetric=False),
        Quant(8, "channel", activations="token"),
        Quant(8, "block", block=(16, 16)),
        Quant(8, "tensor"),
    )
]
_WRONG = [None, "x", "4", "true", [], ["x"], {}, {"a": 1}, True, False, 1.5, 4.0, math.nan, -1, 0, 1, 3]
_DELETE = object()


def _paths(obj: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for k, v in obj.items():
        out.append(prefix + (k,))
        if isinstance(v, dict):
            out += _paths(v, prefix + (k,))
    return out


def _mutated(obj: dict, path: tuple, value) -> dict:
    out = dict(obj)
    if len(path) > 1:
        out[path[0]] = _mutated(obj[path[0]], path[1:], value)
    elif value is _DELETE:
        del out[path[0]]
    else:
        out[path[0]] = value
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """quantization_config dicts as compressed-tensors writes them."""
    return [
        _written(tmp_path_factory.mktemp("ct"), w, a, f)["quantization_config"]
        for w, a, f in (
            (dict(num_bits=4, strategy="group", group_size=32), None, "pack-quantized"),
            (dict(num_bits=8, strategy="channel"), dict(num_bits=8, strategy="token", dynamic=True), "int-quantized"),
        )
    ]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_malformed_quantization_config_is_refused_in_one_line_naming_the_key(written, data):
    qc = data.draw(st.sampled_from(_VALID + written))
    path = data.draw(st.sampled_from(_paths(qc)))
    value = data.draw(st.sampled_from([_DELETE] + _WRONG))
    try:
        got = read_quant_config({"quantization_config": _mutated(qc, path, value)})
    except ValueError as e:
        message = str(e)
        assert "\n" not in message and message.startswith("config.json: "), message
        named = path[-1] if path[-2:-1] != ("config_groups",) or value is not _DELETE else "config_groups"
        assert named in message, f"{'.'.join(path)} = {value!r}: {message}"
    else:
        assert isinstance(got, QuantConfig) and all(isinstance(t, str) for t in got.targets + got.ignore)
