"""Tiny model configs of each family, built in Python (no checkpoint): the smallest Llama (``TINY``: bad-input
tables), a dense Qwen3, a Qwen3-MoE with dense
layers between its MoE layers, and a DeepSeek-V3 with a low-rank query, a dense first layer and grouped routing."""

from functional_npu.models import DeepseekConfig, LlamaConfig, dense, moe
from functional_npu.models.experts import Routing

TINY = LlamaConfig(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=64,
)
DENSE = LlamaConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    qk_norm=True,
)
MOE = moe.MoeConfig(
    architecture="Qwen3MoeForCausalLM",
    **dense.dense_fields(DENSE),
    num_experts=8,
    top_k=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    moe_layers=(1, 3),
)
MLA = DeepseekConfig(
    architecture="DeepseekV3ForCausalLM",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    num_experts=8,
    top_k=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routing=Routing(scoring="sigmoid", group_limit="top2", n_group=2, topk_group=1),
)
