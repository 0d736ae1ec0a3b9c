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
