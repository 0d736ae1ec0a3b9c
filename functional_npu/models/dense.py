"""The dense decoder every family builds on: grouped-query attention with rotary embeddings and a gated MLP in
every layer, a vocab-parallel embedding and head; its config fields, its params, its layouts over a plan and its
blocks. The Llama family is exactly this (:mod:`.llama`); the MoE families (:mod:`.moe`) are it with experts in some
layers, Gemma 3 (:mod:`.gemma3`) with its own norms and attention kinds, DeepSeek (:mod:`.deepseek`) takes its ends.

The functions read a config by the fields the :class:`DenseConfig` protocol names, so any family's config that has
them runs through them; no family module is imported here. The full params, ``Params(tree, cfg)``::

    {"embed": [V, D], "norm": [D], "lm_head": [V, D] (untied only),
     "layers": [{"attn_norm": [D], "qkv": [(H+2K)*hd, D], "qkv_bias": [(H+2K)*hd] (qkv_bias),
                 "q_norm": [hd], "k_norm": [hd] (qk_norm), "o_proj": [D, H*hd],
                 "mlp_norm": [D], "gate_up": [2F, D], "down": [D, F]}, ...]}

The layouts over the plan's tensor-parallel axis (``plan.tp``): ``[q|k|v]`` and ``[gate|up]`` column-parallel (KV
heads replicated when tp > num_kv_heads), ``o_proj`` and ``down`` row-parallel followed by ``all_reduce``, a
vocab-parallel embedding (masked lookup + ``all_reduce``) and lm_head (local logits + ``all_gather``). With module TP
(``plan.module_tp``, :mod:`functional_npu.parallel.module_tp`) o_proj, the MLP, the embedding and lm_head are cut over
data-parallel axes too, and their blocks exchange the group's rows.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ..core.dtypes import float_dtype
from ..core.layout import Block, Layout, fused, replicated, sharded
from ..core.params import Params
from ..core.schema import Field, Rule, read, show
from ..core.tree import map_with_path
from ..parallel.plan import Plan
from .attention import gqa, init_kv, prepare
from .decoder import Blocks
from .embedding import embed, head, head_argmax
from .mlp import gated_mlp
from .rope_params import read_rope

__all__ = [
    "DenseConfig",
    "HF_NAMES",
    "LINEARS",
    "LAYER_LEAVES",
    "SERIES_ALIASES",
    "SIZE_FIELDS",
    "SIZES",
    "SIZE_RULES",
    "FIELDS",
    "ROPE_TYPES",
    "DENSE_FIELDS",
    "architecture",
    "read_sizes",
    "write_sizes",
    "read_dense",
    "dense_fields",
    "write_dense",
    "layer_shapes",
    "abstract_params",
    "dense_params",
    "seeded",
    "param_specs",
    "qkv_blocks",
    "gated_mlp_specs",
    "with_ends",
    "head_axes",
    "ends",
    "blocks",
]


class DenseConfig(Protocol):
    """The fields the dense decoder reads of a config (any family's that has them)."""

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
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None


ROPE_TYPES = ("default", "linear", "llama3")
# the fields read_dense gives (a dense config's, beside its architecture)
DENSE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "rms_norm_eps", "rope_theta", "rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_positions", "max_position_embeddings", "tie_word_embeddings", "qkv_bias", "qk_norm",
    "sliding_window",
)  # fmt: skip

# HF tensor names of each param leaf, in block order ({i}: layer index). The dense decoder's; each family extends it.
HF_NAMES: dict[str, list[str]] = {
    "embed": ["model.embed_tokens.weight"],
    "norm": ["model.norm.weight"],
    "lm_head": ["lm_head.weight"],
    "attn_norm": ["model.layers.{i}.input_layernorm.weight"],
    "qkv": [f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"],
    "qkv_bias": [f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"],
    "q_norm": ["model.layers.{i}.self_attn.q_norm.weight"],
    "k_norm": ["model.layers.{i}.self_attn.k_norm.weight"],
    "o_proj": ["model.layers.{i}.self_attn.o_proj.weight"],
    "mlp_norm": ["model.layers.{i}.post_attention_layernorm.weight"],
    "gate_up": ["model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"],
    "down": ["model.layers.{i}.mlp.down_proj.weight"],
}

# the leaves that are linear layers' weights [out, in]
LINEARS = ("qkv", "o_proj", "gate_up", "down", "lm_head")
# the per-layer leaves that can be layer-sharded, in series order, and the names users also give them
LAYER_LEAVES = ("attn_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj", "mlp_norm", "gate_up", "down")
SERIES_ALIASES = {"q_proj": ("qkv", "qkv_bias"), "down_proj": ("down",)}
# the config fields that fix tensor shapes (named in the loader's shape errors)
SIZE_FIELDS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")


# ---- config.json, as a schema (functional_npu.core.schema) -------------------------------------
# the sizes every dense family reads (read_sizes)
SIZES = (
    Field("vocab_size", "int", "the vocabulary size", low=1),
    Field("hidden_size", "int", "the model width", low=1),
    Field("intermediate_size", "int", "the MLP width", low=1),
    Field("num_hidden_layers", "int", "the number of decoder layers", low=1),
    Field("num_attention_heads", "int", "the number of query heads", low=1),
    Field("num_key_value_heads", "int", "the number of KV heads", default=None, null=None, low=1),
    Field("head_dim", "int", "each head's width", default=None, null=None, low=1),
)
SIZE_RULES = (
    Rule(
        ("num_attention_heads", "num_key_value_heads"),
        lambda v: v["num_attention_heads"] % v["num_key_value_heads"] == 0,
        "{num_attention_heads} query heads cannot be split into {num_key_value_heads} KV groups; num_key_value_heads "
        "must divide num_attention_heads",
        when=lambda v: v["num_key_value_heads"] is not None,
    ),
    Rule(
        ("hidden_size", "num_attention_heads"),
        lambda v: _even_width(v["hidden_size"] // v["num_attention_heads"]),
        "with no head_dim each head is hidden_size // num_attention_heads = {hidden_size} // {num_attention_heads} "
        "wide, but rotary embeddings need an even width of at least 2; give head_dim or fix the sizes",
        when=lambda v: v["head_dim"] is None,
    ),
    Rule(
        ("head_dim",),
        lambda v: v["head_dim"] % 2 == 0,
        "head_dim {head_dim} is odd, but rotary embeddings rotate pairs of dims; it must be even",
        when=lambda v: v["head_dim"] is not None,
    ),
)


def _even_width(head_dim: int) -> bool:
    return head_dim >= 2 and head_dim % 2 == 0


# the rest of a dense config (the rope parameters: functional_npu.models.rope_params)
FIELDS = (
    Field("hidden_act", "str", "the MLP activation", default="silu", choices=("silu",)),
    Field("mlp_bias", "bool", "biases on the MLP", default=False, null=False, choices=(False,)),
    Field("rms_norm_eps", "float", "the RMSNorm epsilon", default=1e-6, gt=0),
    Field("rope_theta", "float", "the rotary base", default=10000.0, gt=0),
    Field("max_position_embeddings", "int", "the longest sequence", default=4096, low=1),
    Field("tie_word_embeddings", "bool", "lm_head shares the embedding", default=False, null=False),
    Field("attention_bias", "bool", "biases on q/k/v", default=False, null=False),
    Field("use_sliding_window", "bool", "sliding-window attention (Qwen2)", default=False, null=False),
    Field("sliding_window", "int", "the attention window (0: none)", default=None, null=None, low=0),
)


def read_sizes(hf: Mapping[str, Any], architectures: tuple[str, ...], where: str = "config.json") -> dict[str, Any]:
    """The architecture and sizes every dense family's config holds (its fields of those names), from a parsed
    ``config.json``: the architecture checked to be one of ``architectures``, the sizes against :data:`SIZES`."""
    arch = architecture(hf, architectures, where)
    v = read(hf, SIZES, SIZE_RULES, where=where, needs=f"a {arch} config")
    heads = v["num_attention_heads"]
    return {
        "architecture": arch,
        "vocab_size": v["vocab_size"],
        "hidden_size": v["hidden_size"],
        "intermediate_size": v["intermediate_size"],
        "num_layers": v["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": v["num_key_value_heads"] or heads,
        "head_dim": v["head_dim"] or v["hidden_size"] // heads,
    }


def architecture(hf: Mapping[str, Any], architectures: tuple[str, ...], where: str = "config.json") -> str:
    """The architecture a parsed ``config.json`` names (the first of its ``architectures``), one of
    ``architectures``."""
    read(hf, (), where=where)  # a JSON object
    given = hf.get("architectures")
    arch = given[0] if isinstance(given, list) and given else None
    if arch not in architectures:
        raise ValueError(
            f"{where}: unsupported architecture {show(arch)} (field 'architectures' is {show(given)}); "
            f"supported: {', '.join(architectures)}"
        )
    return arch


def write_sizes(cfg: Any) -> dict[str, Any]:
    """:func:`read_sizes`' inverse: the ``config.json`` entries of a dense family's architecture and sizes."""
    return {
        "architectures": [cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
    }


def dense_fields(cfg: Any) -> dict[str, Any]:
    """The :data:`DENSE_FIELDS` of ``cfg`` (any config that has them): an MoE config is its dense sibling's fields and
    the experts', ``MoeConfig(architecture=..., **dense_fields(dense_cfg), num_experts=...)``."""
    return {f: getattr(cfg, f) for f in DENSE_FIELDS}


def read_dense(hf: Mapping[str, Any], like: str, where: str = "config.json") -> dict[str, Any]:
    """Every field of :data:`DENSE_FIELDS` from a parsed ``config.json``, checked against :data:`SIZES` and
    :data:`FIELDS`; ``like``, a dense architecture, decides the traits (Qwen2's q/k/v bias, Qwen3's q/k norms,
    Mistral's sliding window)."""
    sizes = read_sizes({**hf, "architectures": [like]}, (like,), where)
    sizes.pop("architecture")
    v = read(hf, FIELDS, where=where, needs=f"a {hf.get('architectures', [like])[0]} config")
    rope = read_rope(hf, ROPE_TYPES, theta=v["rope_theta"], max_positions=v["max_position_embeddings"], where=where)
    sliding = (v["sliding_window"] or None) if like == "MistralForCausalLM" or v["use_sliding_window"] else None
    return sizes | {
        "rms_norm_eps": float(v["rms_norm_eps"]),
        "rope_theta": float(rope["rope_theta"]),
        "rope_type": rope["rope_type"],
        "rope_factor": float(rope.get("factor", 1.0)),
        "rope_low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
        "rope_high_freq_factor": float(rope.get("high_freq_factor", 4.0)),
        "rope_original_max_positions": rope.get("original_max_position_embeddings", v["max_position_embeddings"]),
        "max_position_embeddings": v["max_position_embeddings"],
        "tie_word_embeddings": v["tie_word_embeddings"],
        "qkv_bias": like == "Qwen2ForCausalLM" or v["attention_bias"],
        "qk_norm": like == "Qwen3ForCausalLM",
        "sliding_window": sliding,
    }


def write_dense(cfg: Any) -> dict[str, Any]:
    """:func:`read_dense`'s inverse: the ``config.json`` entries of a dense config (its architecture included)."""
    rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        rope |= {
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_positions,
        }
    return {
        **write_sizes(cfg),
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias,
        "sliding_window": cfg.sliding_window,
    }


# ---- params and the parallel plan -------------------------------------------------------------
def layer_shapes(cfg: DenseConfig) -> dict[str, tuple[int, ...]]:
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    shapes = {
        "attn_norm": (d,),
        "qkv": (qkv, d),
        "o_proj": (d, cfg.num_heads * hd),
        "mlp_norm": (d,),
        "gate_up": (2 * f, d),
        "down": (d, f),
    }
    if cfg.qkv_bias:
        shapes["qkv_bias"] = (qkv,)
    if cfg.qk_norm:
        shapes |= {"q_norm": (hd,), "k_norm": (hd,)}
    return shapes


def abstract_params(
    cfg: DenseConfig, plan: Plan = Plan(), dtype: torch.dtype = torch.float32, device: str | torch.device = "meta"
) -> Params:
    """The full (unsharded) params tree with empty tensors (on the meta device by default: no memory); no
    leaf of the dense decoder depends on the plan."""
    return dense_params(cfg, layer_shapes(cfg), dtype, device)


def dense_params(
    cfg: Any,
    layer: Mapping[str, tuple[int, ...]],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "meta",
) -> Params:
    """The full params tree, with empty tensors, of any family's config whose layers all hold the leaves ``layer``
    (name -> shape): the embedding, the final norm, lm_head (untied only) and ``cfg.num_layers`` layers."""

    def make(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    top: dict[str, Any] = {"embed": make((cfg.vocab_size, cfg.hidden_size)), "norm": make((cfg.hidden_size,))}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = make((cfg.vocab_size, cfg.hidden_size))
    return Params(top | {"layers": [{k: make(v) for k, v in layer.items()} for _ in range(cfg.num_layers)]}, cfg)


def init_params(cfg: DenseConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Params:
    """Full params with seeded random weights (std 0.02, norms 1): an embedded model needing no download."""
    return seeded(abstract_params(cfg), seed, dtype)


def seeded(meta: dict[str, Any], seed: int, dtype: torch.dtype, *, norms: float = 1.0) -> Params:
    """A params tree of ``meta``'s shapes (any family's) with seeded random weights (std 0.02) and every norm
    ``norms``."""
    dtype = float_dtype(dtype, "init_params")
    g = torch.Generator().manual_seed(seed)

    def fill(path: str, x: torch.Tensor) -> torch.Tensor:
        if path.endswith("norm"):
            return torch.full(x.shape, norms, dtype=dtype)
        return (torch.randn(x.shape, generator=g) * 0.02).to(dtype)

    return map_with_path(fill, meta)


def qkv_blocks(cfg: DenseConfig) -> list[Block]:
    hd = cfg.head_dim
    return [
        Block("q", cfg.num_heads * hd, hd),
        Block("k", cfg.num_kv_heads * hd, hd, True),
        Block("v", cfg.num_kv_heads * hd, hd, True),
    ]


def param_specs(cfg: DenseConfig, plan: Plan = Plan()) -> dict[str, Any]:
    """The layouts of ``plan`` (tensor parallelism over ``plan.tp``) as a tree (a prefix of the params).

    A module with module TP (``plan.module_tp``) is cut over its data-parallel axes and ``plan.tp``.
    """
    tp, mtp = plan.tp, plan.module_tp
    qkv = fused(0, qkv_blocks(cfg), tp)
    layer: dict[str, Layout] = {
        "attn_norm": replicated(),
        "qkv": qkv,
        "o_proj": sharded(1, mtp.o_proj + (tp,)),
        "mlp_norm": replicated(),
        **gated_mlp_specs(cfg.intermediate_size, mtp.mlp + (tp,)),
    }
    if cfg.qkv_bias:
        layer["qkv_bias"] = qkv
    if cfg.qk_norm:
        layer |= {"q_norm": replicated(), "k_norm": replicated()}
    return with_ends(cfg, plan, [layer] * cfg.num_layers)


def gated_mlp_specs(intermediate: int, axes: str | tuple[str, ...]) -> dict[str, Layout]:
    """A gated MLP's plan: ``[gate|up]`` column-parallel and ``down`` row-parallel over ``axes``."""
    return {
        "gate_up": fused(0, [Block("gate", intermediate), Block("up", intermediate)], axes),
        "down": sharded(1, axes),
    }


def with_ends(cfg: Any, plan: Plan, layers: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole layout tree (any family's config) from its layers': embedding and lm_head vocab-parallel over
    their module-TP axes and ``plan.tp``, the final norm replicated."""
    tp, mtp = plan.tp, plan.module_tp
    top = {"embed": sharded(0, mtp.embed + (tp,)), "norm": replicated(), "layers": layers}
    return top if cfg.tie_word_embeddings else top | {"lm_head": sharded(0, mtp.lm_head + (tp,))}


def head_axes(cfg: Any, plan: Plan) -> tuple[str, ...]:
    """The head's module-TP axes (any family's config): a tied head multiplies the embedding table, cut as the
    embedding's."""
    return plan.module_tp.embed if cfg.tie_word_embeddings else plan.module_tp.lm_head


def ends(cfg: Any, plan: Plan) -> dict[str, Any]:
    """The embedding, head and greedy head blocks of any family's config (``Blocks`` fields)."""
    tp = plan.tp
    head_args = {"tp": tp, "eps": cfg.rms_norm_eps, "tied": cfg.tie_word_embeddings, "axes": head_axes(cfg, plan)}
    head_args["invariant"] = plan.invariant
    return {
        "embed": functools.partial(embed, tp=tp, axes=plan.module_tp.embed),
        "head": functools.partial(head, **head_args),
        "argmax": functools.partial(head_argmax, **head_args),
    }


def blocks(cfg: DenseConfig, plan: Plan = Plan()) -> Blocks:
    """The decoder's blocks for this config: grouped-query attention and a gated MLP in every layer (with
    ``plan.invariant``, in that invariant mode: :mod:`functional_npu.models.invariant_modes`)."""
    inv = plan.invariant
    mlp = functools.partial(gated_mlp, tp=plan.tp, axes=plan.module_tp.mlp, invariant=inv)
    return Blocks(
        **ends(cfg, plan),
        prepare=functools.partial(prepare, cfg, invariant=inv),
        attention=functools.partial(gqa, cfg=cfg, tp=plan.tp, axes=plan.module_tp.o_proj, invariant=inv),
        ffn=(mlp,) * cfg.num_layers,
        init_kv=functools.partial(init_kv, cfg, tp=plan.tp),
        eps=cfg.rms_norm_eps,
    )
