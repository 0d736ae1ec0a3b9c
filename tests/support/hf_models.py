"""Tiny random transformers models of each supported family, saved with save_pretrained (no network), and
their reference outputs: greedy tokens and prefill logits."""

import json
from pathlib import Path

import torch
import transformers as T

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)
FAMILIES = {
    # llama3 rope scaling, tied embeddings, 2 KV heads (replicated at tp=4)
    "llama3": (
        T.LlamaForCausalLM,
        T.LlamaConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # sliding window shorter than prompt + generation
    "mistral": (
        T.MistralForCausalLM,
        T.MistralConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
    ),
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
MOE_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    max_position_embeddings=256,
    num_attention_heads=4,
    num_key_value_heads=2,
)
MOE_FAMILIES = {
    # softmax, top-2, renormalized (norm_topk_prob), q/k norm
    "qwen3_moe": (
        T.Qwen3MoeForCausalLM,
        T.Qwen3MoeConfig,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=96,
            norm_topk_prob=True,
            head_dim=16,
        ),
    ),
    # softmax, top-2, not renormalized, a sigmoid-gated shared expert, q/k/v bias, a dense first layer
    "qwen2_moe": (
        T.Qwen2MoeForCausalLM,
        T.Qwen2MoeConfig,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            intermediate_size=96,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        ),
    ),
    # softmax, top-2, always renormalized
    "mixtral": (
        T.MixtralForCausalLM,
        T.MixtralConfig,
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
    ),
}


def save_tiny_moe(family: str, path, seed: int, **overrides) -> "T.PreTrainedModel":
    """The MoE family's tiny model with a fixed seed, saved to ``path`` (one tensor per expert), in eval mode."""
    cls, cfg_cls, extra = MOE_FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**(MOE_COMMON | extra | overrides))).eval()
    model.save_pretrained(path)
    return model


def hf_greedy(model: "T.PreTrainedModel", prompt: list[int], new: int, *, use_cache: bool = True) -> list[int]:
    """transformers' greedy continuation of ``prompt``: exactly ``new`` token ids. ``use_cache=False`` runs the
    whole sequence every step (transformers' cached generate leaves Mistral's own forward past the window)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        if use_cache:
            # every id is a token: without a mask, generate takes a pad_token_id in the prompt (Gemma's 0) for padding
            mask = torch.ones_like(ids)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            return out[0, len(prompt) :].tolist()
        seq = ids
        for _ in range(new):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return seq[0, len(prompt) :].tolist()


def hf_references(
    tmp_path_factory, save, families, *, seed: int, model_seed: int, prompt_lens, new: int, uncached=()
) -> dict:
    """{family: (dir, prompts, hf prefill logits per prompt, hf greedy tokens per prompt)}: each family's tiny
    model saved by ``save(family, dir, model_seed + i)``, random prompts of ``prompt_lens`` drawn from a
    generator seeded with ``seed``; the families in ``uncached`` take their greedy tokens without a KV cache."""
    out = {}
    g = torch.Generator().manual_seed(seed)
    for i, name in enumerate(families):
        path = tmp_path_factory.mktemp(name)
        model = save(name, path, model_seed + i)
        prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in prompt_lens]
        with torch.no_grad():
            logits = [model(torch.tensor([p])).logits[0] for p in prompts]
        tokens = [hf_greedy(model, p, new, use_cache=name not in uncached) for p in prompts]
        out[name] = (str(path), prompts, logits, tokens)
    return out


# DeepSeek-V2/V3 (MLA, shared experts, group-limited routing): init std 0.2 so rope layout, routing groups and
# the correction bias move the logits far past the parity tolerance
DEEPSEEK_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.2,
)
DEEPSEEK_FAMILIES = {
    # low-rank query, 2 groups of 4 experts (1 eligible), the first layer dense, interleaved rope
    "deepseek_v3": (
        T.DeepseekV3ForCausalLM,
        T.DeepseekV3Config,
        dict(q_lora_rank=32, n_group=2, topk_group=1, first_k_dense_replace=1),
    ),
    # plain q_proj, 4 groups (2 eligible), every layer MoE, yarn rope with mscale, halves rope layout
    "deepseek_v3_yarn": (
        T.DeepseekV3ForCausalLM,
        T.DeepseekV3Config,
        dict(
            q_lora_rank=None,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=0,
            rope_interleave=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
    # softmax scores, group_limited_greedy, routed_scaling_factor, no renormalization
    "deepseek_v2": (
        T.DeepseekV2ForCausalLM,
        T.DeepseekV2Config,
        dict(
            q_lora_rank=32,
            n_group=2,
            topk_group=1,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
        ),
    ),
}


def save_tiny_deepseek(family: str, path, seed: int, **overrides) -> "T.PreTrainedModel":
    """The DeepSeek family's tiny model with a fixed seed (V3: a random nonzero ``e_score_correction_bias``),
    saved to ``path``, in eval mode."""
    cls, cfg_cls, extra = DEEPSEEK_FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**(DEEPSEEK_COMMON | extra | overrides))).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


# Gemma 3 text: 4 layers of both types, the sliding window (4) shorter than every prompt, each type with its own
# rope base (full layers scaled linearly), a query scale other than head_dim's; the norms (zero at init: the
# identity of Gemma's 1 + weight) drawn at random so the offset matters
GEMMA3_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    sliding_window=4,
    query_pre_attn_scalar=24,
    max_position_embeddings=256,
)
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
}
GEMMA3_FAMILIES = {
    # tied embeddings, 2 KV heads, soft-capped logits, a full layer between sliding ones
    "gemma3": (
        T.Gemma3ForCausalLM,
        T.Gemma3TextConfig,
        dict(
            num_key_value_heads=2,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=GEMMA3_ROPE,
            final_logit_softcapping=0.5,
        ),
    ),
    # untied lm_head, one KV head (replicated at tp 2); its config.json rewritten in the older flat form
    # (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern)
    "gemma3_flat": (
        T.Gemma3ForCausalLM,
        T.Gemma3TextConfig,
        dict(num_key_value_heads=1, tie_word_embeddings=False, sliding_window_pattern=2, rope_parameters=GEMMA3_ROPE),
    ),
}


def save_tiny_gemma3(family: str, path, seed: int, **overrides) -> "T.PreTrainedModel":
    """The Gemma 3 family's tiny model with a fixed seed and random norm weights, saved to ``path`` (``gemma3_flat``:
    its config.json in the older flat form), in eval mode."""
    cls, cfg_cls, extra = GEMMA3_FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**(GEMMA3_COMMON | extra | overrides))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    if family == "gemma3_flat":
        file = Path(path) / "config.json"
        hf = {k: v for k, v in json.loads(file.read_text()).items() if k not in ("layer_types", "rope_parameters")}
        full, sliding = GEMMA3_ROPE["full_attention"], GEMMA3_ROPE["sliding_attention"]
        hf |= {"rope_theta": full["rope_theta"], "rope_local_base_freq": sliding["rope_theta"]}
        hf |= {"rope_scaling": {"rope_type": "linear", "factor": full["factor"]}, "sliding_window_pattern": 2}
        file.write_text(json.dumps(hf))
    return model


def check_parity(result, reference, tol: float = 1e-4) -> None:
    """A ``workers.llama_generate`` result against ``hf_references``' entry: each prompt's prefill logits within
    ``tol`` and its greedy tokens equal."""
    _, prompts, ref_logits, ref_tokens = reference
    logits, tokens, _, _ = result
    for i, p in enumerate(prompts):
        err = (logits[i, : len(p)] - ref_logits[i]).abs().max().item()
        assert err < tol, f"prompt {i}: prefill logits differ by {err}"
        assert tokens[i] == ref_tokens[i], f"prompt {i}: greedy tokens differ"


def causal_lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss (labels = inputs, each token predicted from the ones before it) computed in the
    logits' dtype: ``labels=`` computes it in float32 (``logits.float()``), which in a float64 model is a float32
    step of about 5e-7 in the loss."""
    logits = model(batch).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def float64_norms(model):
    """``model`` with every RMSNorm computed in the input's dtype. transformers computes them in float32 whatever the
    model's dtype (``hidden_states.to(torch.float32)``), a float32 step inside a float64 reference; this library's
    norm follows the params' dtype. The norms' formulas are transformers' own (Gemma's ``1 + weight`` kept)."""
    for m in model.modules():
        if not type(m).__name__.endswith("RMSNorm"):
            continue
        if hasattr(m, "variance_epsilon"):  # Llama's form: weight * normalized
            m.forward = lambda x, m=m: (
                m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon))
            )
        else:  # Gemma's: normalized * (1 + weight)
            m.forward = lambda x, m=m: m._norm(x) * (1.0 + m.weight)
    return model
