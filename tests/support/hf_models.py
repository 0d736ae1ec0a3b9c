"""Tiny random transformers models of each supported family, saved with save_pretrained (no network)."""

import torch
import transformers as T

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)
FAMILIES = {
    # llama3 rope scaling, tied embeddings, 2 KV heads (replicated at tp=4)
    "llama3": (T.LlamaForCausalLM, T.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # sliding window shorter than prompt + generation
    "mistral": (T.MistralForCausalLM, T.MistralConfig, dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8)),
    # q/k/v bias, a single KV head (replicated at tp=2 and 4)
    "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=1)),
    # q/k RMSNorm, head_dim != hidden / heads; saved as a sharded index
    "qwen3": (T.Qwen3ForCausalLM, T.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
}


def save_tiny(family: str, path, seed: int, **overrides) -> "T.PreTrainedModel":
    """Build the family's tiny model with a fixed seed, save it to ``path``, return it (eval mode)."""
    cls, cfg_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**(COMMON | extra | overrides))).eval()
    model.save_pretrained(path, **({"max_shard_size": "100KB"} if family == "qwen3" else {}))
    return model

# Mixture-of-experts families: 8 experts, top-2, hidden 64, 2 layers (expert parallelism tests).
MOE_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, max_position_embeddings=256, num_attention_heads=4, num_key_value_heads=2)
MOE_FAMILIES = {
    # softmax, top-2, renormalized (norm_topk_prob), q/k norm
    "qwen3_moe": (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                                                              norm_topk_prob=True, head_dim=16)),
    # softmax, top-2, always renormalized
    "mixtral": (T.MixtralForCausalLM, T.MixtralConfig, dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48)),
}


def save_tiny_moe(family: str, path, seed: int) -> "T.PreTrainedModel":
    """The MoE family's tiny model with a fixed seed, saved to ``path`` (one tensor per expert), in eval mode."""
    cls, cfg_cls, extra = MOE_FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**MOE_COMMON, **extra)).eval()
    model.save_pretrained(path)
    return model
