"""The benchmarks' dense models: a Qwen3-style config at two small sizes (seeded random weights, fp32), and the shapes
of two released Qwen3 models, for measurements at the sizes users serve (random weights, nothing downloaded)."""

from __future__ import annotations

from functional_npu.models.llama import LlamaConfig

__all__ = ["FULL", "QUICK", "QWEN3_0_6B", "QWEN3_8B", "REAL"]

_MODEL = dict(
    architecture="Qwen3ForCausalLM",
    hidden_size=512,
    intermediate_size=1536,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=2048,
    qk_norm=True,
)
FULL = LlamaConfig(vocab_size=32000, num_layers=12, **_MODEL)  # about 70M params, untied, fp32
QUICK = LlamaConfig(vocab_size=8000, num_layers=4, **_MODEL)

_QWEN3 = dict(
    architecture="Qwen3ForCausalLM",
    vocab_size=151936,
    head_dim=128,
    num_kv_heads=8,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=40960,
    qk_norm=True,
    tie_word_embeddings=False,
)
# Qwen/Qwen3-0.6B's config.json, with an untied head (the released model ties it): 0.75B params, 0.44B in its layers
QWEN3_0_6B = LlamaConfig(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, **_QWEN3)
# Qwen/Qwen3-8B's config.json (untied, as released): 8.19B params
QWEN3_8B = LlamaConfig(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, **_QWEN3)
REAL = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B}
