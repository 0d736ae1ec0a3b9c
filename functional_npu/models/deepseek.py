"""DeepSeek-V2 / V3: multi-head latent attention, MoE with shared experts, group-limited routing.

A family is a config, a HF name table, a parallel plan and a choice of blocks for the one decoder:
here MLA (:mod:`functional_npu.models.mla`, latent KV cache, absorbed decode) in every layer, a dense
gated MLP in the first ``first_k_dense_replace`` layers and the experts block
(:mod:`functional_npu.models.experts`) with shared experts in the others. Routing as transformers:

- V3: sigmoid scores; ``e_score_correction_bias`` added to choose; groups ranked by their best two;
  ``topk_group`` of ``n_group`` eligible; weights the uncorrected scores, renormalized
  (``norm_topk_prob``), times ``routed_scaling_factor``;
- V2: softmax scores; ``greedy`` or ``group_limited_greedy`` (groups ranked by their best score);
  times ``routed_scaling_factor``.

The layouts over the plan's ``tp``: ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` column-parallel over heads,
``o_proj`` row-parallel; ``q_a_proj``, ``kv_a_proj`` (``kv_a_proj_with_mqa``), their norms and the
latent cache replicated; experts over the plan's ``expert_axes`` (tensor-parallel over tp otherwise), shared
experts and dense MLPs column / row parallel; module TP (``module_tp``) as in the Llama family.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core.dtypes import float_dtype
from ..core.layout import Block, Layout, fused, replicated, sharded
from ..core.params import Params
from ..core.schema import Field, Rule, check_rules, read, show
from ..core.tree import map_with_path, register_static
from ..parallel.plan import Plan
from . import dense, mla
from .decoder import Blocks
from .experts import Routing, expert_specs, identity_map, moe_ffn
from .mlp import gated_mlp
from .rope_params import read_rope

__all__ = [
    "DeepseekConfig",
    "ARCHITECTURES",
    "LINEARS",
    "SIZE_FIELDS",
    "LAYER_LEAVES",
    "SERIES_ALIASES",
    "unread",
    "hf_names",
    "abstract_params",
    "init_params",
    "param_specs",
    "blocks",
]

ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
_MODEL_TYPE = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2"}
ROPE_TYPES = ("default", "yarn")
GROUP_LIMITS = ("noaux_tc", "greedy", "group_limited_greedy")  # topk_method
LINEARS = (
    "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj", "gate_up", "down", "lm_head",
    "router", "experts_gate_up", "experts_down", "shared_gate_up", "shared_down",
)  # fmt: skip

LAYER_LEAVES = (
    "attn_norm", "q_proj", "q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_norm", "kv_b_proj", "o_proj",
    "mlp_norm", "gate_up", "down",
)  # fmt: skip
SERIES_ALIASES = {"down_proj": ("down",)}


# ---- config.json, as a schema (functional_npu.core.schema; the rope parameters: models.rope_params) ----------
FIELDS = (
    Field("vocab_size", "int", "the vocabulary size", low=1),
    Field("hidden_size", "int", "the model width", low=1),
    Field("intermediate_size", "int", "the dense MLP width", low=1),
    Field("num_hidden_layers", "int", "the number of decoder layers", low=1),
    Field("num_attention_heads", "int", "the number of heads", low=1),
    Field("q_lora_rank", "int", "the compressed query's rank (null: a full q_proj)", default=None, null=None, low=1),
    Field("kv_lora_rank", "int", "the rank of the compressed KV", low=1),
    Field("qk_nope_head_dim", "int", "each head's query/key width without rope", low=1),
    Field("qk_rope_head_dim", "int", "each head's rotated query/key width", low=2),
    Field("v_head_dim", "int", "each head's value width", low=1),
    Field("rms_norm_eps", "float", "the RMSNorm epsilon", default=1e-6, gt=0),
    Field("rope_theta", "float", "the rotary base", default=10000.0, gt=0),
    Field("max_position_embeddings", "int", "the longest sequence", default=4096, low=1),
    Field("tie_word_embeddings", "bool", "lm_head shares the embedding", default=False, null=False),
    Field("rope_interleave", "bool", "rotate interleaved pairs (V3)", default=True, null=True),
    Field("n_routed_experts", "int", "the number of routed experts", low=1),
    Field("num_experts_per_tok", "int", "the experts each token is routed to", low=1),
    Field("moe_intermediate_size", "int", "each expert's MLP width", low=1),
    Field("n_shared_experts", "int", "the number of shared experts", default=0, null=0, low=0),
    Field("first_k_dense_replace", "int", "the leading layers with a dense MLP", default=0, null=0, low=0),
    Field("norm_topk_prob", "bool", "renormalize the top-k weights (V3)", default=False, null=False),
    Field("topk_method", "str", "the routing", default=None, null=None, choices=GROUP_LIMITS),
    Field("n_group", "int", "the expert groups", default=1, null=1, low=1),
    Field("topk_group", "int", "the groups each token may use", default=1, null=1, low=1),
    Field("routed_scaling_factor", "float", "the routed experts' weight scale", default=1.0, null=1.0, gt=0),
    Field("num_nextn_predict_layers", "int", "the multi-token-prediction layers", default=0, null=0, low=0),
)
_GROUPED = ("noaux_tc", "group_limited_greedy")
RULES = (
    Rule(
        ("num_experts_per_tok", "n_routed_experts"),
        lambda v: v["num_experts_per_tok"] <= v["n_routed_experts"],
        "{num_experts_per_tok} experts per token is more than the model's {n_routed_experts} experts; lower "
        "num_experts_per_tok",
    ),
    Rule(
        ("first_k_dense_replace", "num_hidden_layers"),
        lambda v: v["first_k_dense_replace"] <= v["num_hidden_layers"],
        "{first_k_dense_replace} leading dense layers is more than the model's {num_hidden_layers} layers; lower "
        "first_k_dense_replace",
    ),
    Rule(
        ("qk_rope_head_dim",),
        lambda v: v["qk_rope_head_dim"] % 2 == 0,
        "qk_rope_head_dim {qk_rope_head_dim} is odd, but rotary embeddings rotate pairs of dims; it must be even",
    ),
    Rule(
        ("n_group", "n_routed_experts"),
        lambda v: v["n_routed_experts"] % v["n_group"] == 0,
        "{topk_method} routing splits the {n_routed_experts} experts into n_group={n_group} equal groups, but "
        "{n_group} does not divide {n_routed_experts}; use an n_group that does",
        when=lambda v: v["topk_method"] in _GROUPED,
    ),
    Rule(
        ("topk_group", "n_group"),
        lambda v: v["topk_group"] <= v["n_group"],
        "topk_group={topk_group} groups per token is more than the n_group={n_group} groups; lower topk_group",
        when=lambda v: v["topk_method"] in _GROUPED,
    ),
    Rule(
        ("n_group", "n_routed_experts"),
        lambda v: v["n_routed_experts"] // v["n_group"] >= 2,
        "noaux_tc ranks each group by its best two experts, but n_group={n_group} leaves "
        "{n_routed_experts} // {n_group} per group; use fewer groups",
        when=lambda v: v["topk_method"] == "noaux_tc" and v["n_group"] > 1,
    ),
    Rule(
        ("num_experts_per_tok", "topk_group", "n_group"),
        lambda v: v["num_experts_per_tok"] <= v["topk_group"] * (v["n_routed_experts"] // v["n_group"]),
        "{num_experts_per_tok} experts per token is more than the topk_group={topk_group} eligible groups hold "
        "({topk_group} x {n_routed_experts} // {n_group}); raise topk_group or lower num_experts_per_tok",
        when=lambda v: v["topk_method"] in _GROUPED and v["n_group"] > 1,
    ),
)
SIZE_FIELDS = (
    "hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "intermediate_size", "vocab_size", "num_experts", "moe_intermediate_size",
)  # fmt: skip
_LAYER = "model.layers.{i}."
HF_NAMES: dict[str, list[str]] = {
    "embed": ["model.embed_tokens.weight"],
    "norm": ["model.norm.weight"],
    "lm_head": ["lm_head.weight"],
    "attn_norm": [_LAYER + "input_layernorm.weight"],
    "mlp_norm": [_LAYER + "post_attention_layernorm.weight"],
    "q_proj": [_LAYER + "self_attn.q_proj.weight"],
    "q_a_proj": [_LAYER + "self_attn.q_a_proj.weight"],
    "q_a_norm": [_LAYER + "self_attn.q_a_layernorm.weight"],
    "q_b_proj": [_LAYER + "self_attn.q_b_proj.weight"],
    "kv_a_proj": [_LAYER + "self_attn.kv_a_proj_with_mqa.weight"],
    "kv_a_norm": [_LAYER + "self_attn.kv_a_layernorm.weight"],
    "kv_b_proj": [_LAYER + "self_attn.kv_b_proj.weight"],
    "o_proj": [_LAYER + "self_attn.o_proj.weight"],
    "gate_up": [_LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight"],
    "down": [_LAYER + "mlp.down_proj.weight"],
    "router": [_LAYER + "mlp.gate.weight"],
    "router_bias": [_LAYER + "mlp.gate.e_score_correction_bias"],
    "experts_gate_up": [_LAYER + "mlp.experts.{j}.gate_proj.weight", _LAYER + "mlp.experts.{j}.up_proj.weight"],
    "experts_down": [_LAYER + "mlp.experts.{j}.down_proj.weight"],
    "shared_gate_up": [_LAYER + "mlp.shared_experts.gate_proj.weight", _LAYER + "mlp.shared_experts.up_proj.weight"],
    "shared_down": [_LAYER + "mlp.shared_experts.down_proj.weight"],
    "expert_map": [],
}


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepseekConfig:
    """Static config of a DeepSeek-V2 / V3 model (what its ``config.json`` says; the placement, the decode
    path and the cache kind are the plan's)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_positions: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    rope_attention_factor: float | None = None
    rope_truncate: bool = True
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    routing: Routing = Routing()
    mtp_layers: int = 0  # num_nextn_predict_layers: stored after the decoder's layers, not run

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense_replace, self.num_layers))

    def cache_values_per_token(self, plan: Plan) -> int:
        """Cache values per token and layer: the latent and the rope key (all heads share them), or with
        ``plan.mla_cache == "heads"`` every head's key and value."""
        if plan.mla_cache == "heads":
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return self.kv_lora_rank + self.qk_rope_head_dim

    @staticmethod
    def from_hf(hf: Mapping[str, Any], where: str = "config.json") -> DeepseekConfig:
        """Build from a parsed HF ``config.json``, checked against :data:`FIELDS` and :data:`RULES`; one line
        naming ``where`` and the field for anything malformed, or an option this family does not run."""
        arch = dense.architecture(hf, ARCHITECTURES, where)
        _refuse(hf, where)
        v = read(hf, FIELDS, where=where, needs=f"a {arch} config")
        v3 = arch == "DeepseekV3ForCausalLM"
        method = v["topk_method"] or ("noaux_tc" if v3 else "greedy")
        if (method == "noaux_tc") != v3:
            raise ValueError(
                f"{where}: topk_method {method!r} is not supported for {arch}; "
                f"use {'noaux_tc' if v3 else 'greedy or group_limited_greedy'}"
            )
        check_rules(v | {"topk_method": method}, RULES, where=where)
        rope = read_rope(hf, ROPE_TYPES, theta=v["rope_theta"], max_positions=v["max_position_embeddings"], where=where)
        limit = {"noaux_tc": "top2", "group_limited_greedy": "max", "greedy": "none"}[method]
        return DeepseekConfig(
            architecture=arch,
            vocab_size=v["vocab_size"],
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_layers=v["num_hidden_layers"],
            num_heads=v["num_attention_heads"],
            q_lora_rank=v["q_lora_rank"],
            kv_lora_rank=v["kv_lora_rank"],
            qk_nope_head_dim=v["qk_nope_head_dim"],
            qk_rope_head_dim=v["qk_rope_head_dim"],
            v_head_dim=v["v_head_dim"],
            rms_norm_eps=float(v["rms_norm_eps"]),
            rope_theta=float(rope["rope_theta"]),
            rope_type=rope["rope_type"],
            rope_factor=float(rope.get("factor", 1.0)),
            rope_original_max_positions=rope.get("original_max_position_embeddings", v["max_position_embeddings"]),
            rope_beta_fast=float(rope.get("beta_fast", 32.0)),
            rope_beta_slow=float(rope.get("beta_slow", 1.0)),
            rope_mscale=float(rope.get("mscale", 0.0)),
            rope_mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
            rope_attention_factor=rope.get("attention_factor"),
            rope_truncate=rope.get("truncate", True),
            rope_interleave=v["rope_interleave"] if v3 else True,  # V2 rotates adjacent pairs
            max_position_embeddings=v["max_position_embeddings"],
            tie_word_embeddings=v["tie_word_embeddings"],
            num_experts=v["n_routed_experts"],
            top_k=v["num_experts_per_tok"],
            moe_intermediate_size=v["moe_intermediate_size"],
            n_shared_experts=v["n_shared_experts"],
            first_k_dense_replace=v["first_k_dense_replace"],
            norm_topk_prob=v["norm_topk_prob"] if v3 else False,  # V2's router never renormalizes
            mtp_layers=v["num_nextn_predict_layers"],
            routing=Routing(
                scoring="sigmoid" if v3 else "softmax",
                group_limit=limit,
                n_group=v["n_group"],
                topk_group=v["topk_group"],
                scale=float(v["routed_scaling_factor"]),
            ),
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (read back by :meth:`from_hf`)."""
        rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "yarn":
            rope |= {
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.rope_original_max_positions,
                "beta_fast": self.rope_beta_fast,
                "beta_slow": self.rope_beta_slow,
                "mscale": self.rope_mscale,
                "mscale_all_dim": self.rope_mscale_all_dim,
            }
        method = {"top2": "noaux_tc", "max": "group_limited_greedy", "none": "greedy"}[self.routing.group_limit]
        return {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPE[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "rope_interleave": self.rope_interleave,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "n_routed_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_shared_experts": self.n_shared_experts,
            "first_k_dense_replace": self.first_k_dense_replace,
            "norm_topk_prob": self.norm_topk_prob,
            "topk_method": method,
            "n_group": self.routing.n_group,
            "topk_group": self.routing.topk_group,
            "routed_scaling_factor": self.routing.scale,
            "num_nextn_predict_layers": self.mtp_layers,
        }


def _refuse(hf: Mapping[str, Any], where: str) -> None:
    """One line for each option this family does not run."""
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{where}: attention_bias / mlp_bias are not supported for DeepSeek models; set them to false")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {show(hf.get('hidden_act'))} is not supported (silu only)")
    if (hf.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"{where}: moe_layer_freq {show(hf.get('moe_layer_freq'))} is not supported (1 only)")
    quant = hf.get("quantization_config")
    if isinstance(quant, Mapping) and quant.get("quant_method") == "fp8":
        raise ValueError(
            f"{where}: fp8 block-quantized weights (quantization_config.quant_method 'fp8') are not supported; "
            "convert the checkpoint to bf16 or to a compressed-tensors scheme"
        )
    for key in ("index_topk", "index_n_heads"):  # DeepSeek-V3.2's sparse attention indexer
        if hf.get(key):
            raise ValueError(f"{where}: {key} (DeepSeek-V3.2 sparse attention) is not supported")


register_static(DeepseekConfig)


def unread(cfg: DeepseekConfig) -> tuple[str, ...]:
    """Name prefixes of stored tensors the model does not run: the multi-token-prediction layers
    (``num_nextn_predict_layers``), stored after the decoder's."""
    return tuple(f"model.layers.{cfg.num_layers + k}." for k in range(cfg.mtp_layers))


def hf_names(cfg: DeepseekConfig) -> dict[str, list[str]]:
    """HF tensor names of each param leaf in block order (``{i}``: layer, ``{j}``: expert); expert_map is computed."""
    return HF_NAMES


# ---- the parallel plan ------------------------------------------------------------------------
def _attention_shapes(cfg: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    d, h = cfg.hidden_size, cfg.num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {"attn_norm": (d,)}
    if cfg.q_lora_rank is None:
        shapes["q_proj"] = (h * qk, d)
    else:
        shapes |= {
            "q_a_proj": (cfg.q_lora_rank, d),
            "q_a_norm": (cfg.q_lora_rank,),
            "q_b_proj": (h * qk, cfg.q_lora_rank),
        }
    return shapes | {
        "kv_a_proj": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d),
        "kv_a_norm": (cfg.kv_lora_rank,),
        "kv_b_proj": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "o_proj": (d, h * cfg.v_head_dim),
        "mlp_norm": (d,),
    }


def _ffn_shapes(cfg: DeepseekConfig, plan: Plan, moe: bool) -> dict[str, tuple[int, ...]]:
    d = cfg.hidden_size
    if not moe:
        return {"gate_up": (2 * cfg.intermediate_size, d), "down": (d, cfg.intermediate_size)}
    f, s = cfg.moe_intermediate_size, plan.slots(cfg.num_experts)
    shapes = {"router": (cfg.num_experts, d), "experts_gate_up": (s, 2 * f, d), "experts_down": (s, d, f)}
    if cfg.routing.group_limit == "top2":
        shapes["router_bias"] = (cfg.num_experts,)
    if cfg.n_shared_experts:
        fs = f * cfg.n_shared_experts
        shapes |= {"shared_gate_up": (2 * fs, d), "shared_down": (d, fs)}
    return shapes


def abstract_params(
    cfg: DeepseekConfig, plan: Plan = Plan(), dtype: torch.dtype = torch.float32, device: str | torch.device = "meta"
) -> Params:
    """The full (unsharded) params tree with empty tensors (on the meta device by default: no memory), with the
    plan's expert slots and copies."""

    def make(shape: tuple[int, ...], dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dt, device=device)

    layers = []
    for i in range(cfg.num_layers):
        moe = i in cfg.moe_layers
        layer = {k: make(v) for k, v in (_attention_shapes(cfg) | _ffn_shapes(cfg, plan, moe)).items()}
        if moe:
            layer["expert_map"] = make((cfg.num_experts, plan.max_copies), torch.int64)
        layers.append(layer)
    top: dict[str, Any] = {"embed": make((cfg.vocab_size, cfg.hidden_size)), "norm": make((cfg.hidden_size,))}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = make((cfg.vocab_size, cfg.hidden_size))
    return Params(top | {"layers": layers}, cfg)


def init_params(cfg: DeepseekConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Params:
    """Full params with seeded random weights (std 0.02, norms 1, router bias 0) and the identity expert map."""
    dtype = float_dtype(dtype, "init_params")
    g = torch.Generator().manual_seed(seed)

    def fill(path: str, x: torch.Tensor) -> torch.Tensor:
        if path.endswith("expert_map"):
            return identity_map(cfg.num_experts)
        if path.endswith("norm"):
            return torch.ones(x.shape, dtype=dtype)
        if path.endswith("router_bias"):
            return torch.zeros(x.shape, dtype=dtype)
        return (torch.randn(x.shape, generator=g) * 0.02).to(dtype)

    return map_with_path(fill, abstract_params(cfg))


def param_specs(cfg: DeepseekConfig, plan: Plan = Plan()) -> dict[str, Any]:
    """The layouts of ``plan`` (over ``plan.tp`` and the expert and module-TP axes) as a tree."""
    tp, mtp = plan.tp, plan.module_tp
    qk, kv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
    heads_q = fused(0, [Block("q", cfg.num_heads * qk, qk)], tp)  # whole heads per rank
    attention: dict[str, Layout] = {
        "attn_norm": replicated(),
        "q_proj": heads_q,
        "q_a_proj": replicated(),
        "q_a_norm": replicated(),
        "q_b_proj": heads_q,
        "kv_a_proj": replicated(),
        "kv_a_norm": replicated(),
        "kv_b_proj": fused(0, [Block("kv", cfg.num_heads * kv, kv)], tp),
        "o_proj": sharded(1, mtp.o_proj + (tp,)),
        "mlp_norm": replicated(),
    }
    mlp = dense.gated_mlp_specs(cfg.intermediate_size, mtp.mlp + (tp,))
    moe = {"router": replicated(), "router_bias": replicated()}
    moe |= expert_specs(cfg, plan, cfg.moe_intermediate_size * cfg.n_shared_experts)
    meta = abstract_params(cfg, plan)
    layers = [
        {k: v for k, v in (attention | (moe if i in cfg.moe_layers else mlp)).items() if k in meta["layers"][i]}
        for i in range(cfg.num_layers)
    ]
    return dense.with_ends(cfg, plan, layers)


def blocks(cfg: DeepseekConfig, plan: Plan = Plan()) -> Blocks:
    """MLA in every layer; a dense gated MLP in the first ``first_k_dense_replace``, experts in the rest (with
    ``plan.invariant``, in that invariant mode: :mod:`functional_npu.models.invariant_modes`)."""
    mlp = functools.partial(gated_mlp, tp=plan.tp, axes=plan.module_tp.mlp, invariant=plan.invariant)
    experts = functools.partial(moe_ffn, cfg=cfg, plan=plan)
    return Blocks(
        **dense.ends(cfg, plan),
        prepare=functools.partial(mla.prepare, cfg, invariant=plan.invariant),
        attention=functools.partial(mla.mla, cfg=cfg, plan=plan),
        ffn=tuple(experts if i in cfg.moe_layers else mlp for i in range(cfg.num_layers)),
        init_kv=functools.partial(mla.init_kv, cfg, plan=plan),
        eps=cfg.rms_norm_eps,
    )
