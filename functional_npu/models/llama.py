"""The Llama family: Llama 2/3 (llama3 / linear rope scaling, tied embeddings), Mistral (sliding
window), Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm).

A family is a config, a HF name table, a parallel plan and a choice of blocks for the one decoder
(:mod:`functional_npu.models.decoder`). This one is the dense decoder itself (:mod:`.dense`: grouped-query attention
and a gated MLP in every layer, its params, layouts and blocks), with its config and Megatron-Core's names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.layout import Block, Layout, fused
from ..core.tree import register_static
from ..parallel.plan import Plan
from .dense import (
    HF_NAMES,
    LAYER_LEAVES,
    LINEARS,
    SERIES_ALIASES,
    SIZE_FIELDS,
    abstract_params,
    architecture,
    blocks,
    init_params,
    param_specs,
    qkv_blocks,
    read_dense,
    write_dense,
)

__all__ = [
    "LlamaConfig",
    "ARCHITECTURES",
    "HF_NAMES",
    "LINEARS",
    "SIZE_FIELDS",
    "MEGATRON_NAMES",
    "MEGATRON_ALIASES",
    "megatron_layouts",
    "LAYER_LEAVES",
    "SERIES_ALIASES",
    "abstract_params",
    "init_params",
    "param_specs",
    "blocks",
]

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# Megatron-Core parameter name -> our leaf path ({i}: layer index, local to its pipeline chunk on the Megatron side)
MEGATRON_NAMES: dict[str, str] = {
    "embedding.word_embeddings.weight": "embed",
    "decoder.final_layernorm.weight": "norm",
    "output_layer.weight": "lm_head",
    "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight": "layers.{i}.attn_norm",
    "decoder.layers.{i}.self_attention.linear_qkv.weight": "layers.{i}.qkv",
    "decoder.layers.{i}.self_attention.linear_qkv.bias": "layers.{i}.qkv_bias",
    "decoder.layers.{i}.self_attention.q_layernorm.weight": "layers.{i}.q_norm",
    "decoder.layers.{i}.self_attention.k_layernorm.weight": "layers.{i}.k_norm",
    "decoder.layers.{i}.self_attention.linear_proj.weight": "layers.{i}.o_proj",
    "decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight": "layers.{i}.mlp_norm",
    "decoder.layers.{i}.mlp.linear_fc1.weight": "layers.{i}.gate_up",
    "decoder.layers.{i}.mlp.linear_fc2.weight": "layers.{i}.down",
}
# Megatron's local (non Transformer-Engine) spec names the two norms on their own
MEGATRON_ALIASES: dict[str, str] = {
    "decoder.layers.{i}.input_layernorm.weight": "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.{i}.pre_mlp_layernorm.weight": "decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    """Static model config, read from a HF ``config.json`` by :meth:`from_hf`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    @staticmethod
    def from_hf(hf: Mapping[str, Any], where: str = "config.json") -> LlamaConfig:
        """Build from a parsed HF ``config.json``, checked against the dense decoder's schema
        (:func:`~functional_npu.models.dense.read_dense`; one line naming ``where`` and the field for anything
        malformed or unsupported)."""
        arch = architecture(hf, ARCHITECTURES, where)
        return LlamaConfig(architecture=arch, **read_dense(hf, arch, where))

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict for this config (read back by :meth:`from_hf`)."""
        return write_dense(self) | {"model_type": MODEL_TYPES[self.architecture]}


# The config rides along in the params tree as a node with no leaves: pytree maps keep it.
register_static(LlamaConfig)


def megatron_layouts(cfg: LlamaConfig, plan: Plan) -> dict[str, Layout]:
    """The leaves Megatron cuts unlike :func:`param_specs`: ``linear_qkv`` holds whole KV groups
    ``[q heads of group g, k_g, v_g]`` per tensor-parallel rank (``[q|k|v]`` grouped by KV head)."""
    groups = [Block(b.name, b.size, b.unit) for b in qkv_blocks(cfg)]  # whole groups per rank: none replicated
    qkv = fused(0, groups, plan.tp, groups=cfg.num_kv_heads)
    return {"qkv": qkv, "qkv_bias": qkv}
