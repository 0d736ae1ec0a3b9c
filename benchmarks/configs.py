"""The benchmarks' dense model: a Qwen3-style config at two sizes (seeded random weights, fp32)."""

from __future__ import annotations

from functional_npu.models.llama import LlamaConfig

__all__ = ["FULL", "QUICK"]

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
