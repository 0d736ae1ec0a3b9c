"""Each family's config.json schema under malformed input: hypothesis deletes a key, sets it null, gives it a value
of another type or out of range, in valid configs (the tiny ones here and transformers' own); ``from_hf`` either
reads a config the model runs with, or refuses in one line naming the key, and never raises anything else."""

import math

import pytest
import torch
import transformers as T
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu.models import family_of
from functional_npu.models.experts import route
from tests.support.configs import DENSE, MLA, MOE

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
_SMALL |= dict(num_attention_heads=4, num_key_value_heads=2)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)


def _hf(cfg) -> dict:
    """A transformers config's config.json, as it saves it."""
    return cfg.to_dict() | {"architectures": [cfg.architectures[0]]}


# family -> valid config.json dicts
VALID = {
    "llama": [
        DENSE.to_hf(),
        _hf(
            T.LlamaConfig(
                **_SMALL,
                architectures=["LlamaForCausalLM"],
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 5e5,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 1024,
                },
            )
        ),
        _hf(T.Qwen2Config(**_SMALL, architectures=["Qwen2ForCausalLM"])),
        _hf(T.MistralConfig(**_SMALL, head_dim=8, architectures=["MistralForCausalLM"])),
    ],
    "moe": [
        MOE.to_hf(),
        _hf(
            T.MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2, architectures=["MixtralForCausalLM"])
        ),
        _hf(
            T.Qwen2MoeConfig(
                **_SMALL | _MOE,
                num_experts=4,
                shared_expert_intermediate_size=24,
                architectures=["Qwen2MoeForCausalLM"],
            )
        ),
    ],
    "deepseek": [
        MLA.to_hf(),
        _hf(
            T.DeepseekV3Config(
                **_SMALL,
                **_MOE,
                n_routed_experts=8,
                n_group=2,
                topk_group=1,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=4,
                v_head_dim=8,
                first_k_dense_replace=1,
                architectures=["DeepseekV3ForCausalLM"],
            )
        ),
    ],
    "gemma3": [
        _hf(T.Gemma3TextConfig(**_SMALL, head_dim=8, sliding_window=4, architectures=["Gemma3ForCausalLM"])),
    ],
}
# what a key is set to: null, other types, out of range, off by a little
WRONG = [None, "x", "4", "true", [], ["x"], {}, {"a": 1}, True, False, 1.5, 4.0, math.nan, -1, 0, 1, 3]


def _paths(hf: dict, prefix: tuple = ()) -> list[tuple]:
    """Every key's path in ``hf``, nested objects (the rope parameters) included."""
    out = []
    for k, v in hf.items():
        out.append(prefix + (k,))
        if isinstance(v, dict):
            out += _paths(v, prefix + (k,))
    return out


def _mutated(hf: dict, path: tuple, value) -> dict:
    out = dict(hf)
    if len(path) > 1:
        out[path[0]] = _mutated(hf[path[0]], path[1:], value)
    elif value is _DELETE:
        del out[path[0]]
    else:
        out[path[0]] = value
    return out


_DELETE = object()


def _runs(cfg) -> None:
    """What a config must allow: its params' shapes, and routing every token to its top-k experts."""
    family = family_of(cfg)
    family.abstract_params(cfg)
    if hasattr(cfg, "num_experts"):
        weights, experts = route(torch.randn(3, cfg.num_experts), cfg)
        assert experts.shape == (3, cfg.top_k) and bool((experts < cfg.num_experts).all())


def test_gemma3_layer_types_empty_is_refused_not_replaced():
    """transformers refuses ``layer_types: []``; read as "no layer types" it once became the default pattern."""
    hf = dict(VALID["gemma3"][0]) | {"layer_types": []}
    with pytest.raises(ValueError, match=r"^config.json: layer_types must give one of .* layers, got 0: \[\]"):
        family_of("Gemma3ForCausalLM").from_hf(hf)


@pytest.mark.parametrize("family", list(VALID))
def test_the_valid_configs_read(family):
    for hf in VALID[family]:
        _runs(family_of(hf["architectures"][0]).from_hf(hf))


@pytest.mark.parametrize("family", list(VALID))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_malformed_config_is_refused_in_one_line_naming_the_key(family, data):
    hf = data.draw(st.sampled_from(VALID[family]))
    path = data.draw(st.sampled_from(_paths(hf)))
    value = data.draw(st.sampled_from([_DELETE] + WRONG))
    bad = _mutated(hf, path, value)
    try:
        cfg = family_of(hf["architectures"][0]).from_hf(bad)
    except ValueError as e:
        message = str(e)
        assert "\n" not in message and message.startswith("config.json: "), message
        assert path[-1] in message, f"{'.'.join(path)} = {value!r}: {message}"
    else:
        _runs(cfg)
