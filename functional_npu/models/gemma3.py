"""The Gemma 3 text family (``Gemma3ForCausalLM``, model_type ``gemma3_text``): sliding-window and full
attention layers interleaved, each layer type with its own rotary embedding.

A family is a config, a HF name table, a parallel plan and a choice of blocks for the one decoder
(:mod:`functional_npu.models.decoder`). Gemma 3 takes the Llama family's plan and blocks (grouped-query
attention with per-head q / k norms, a gated MLP, a vocab-parallel embedding and head) with these options,
each as transformers' ``modeling_gemma3`` computes it:

- every RMSNorm scales by ``1 + weight`` (the stored weight is the offset from 1), applied in float32;
- four norms per layer: ``attn_norm`` before attention, ``post_attn_norm`` on its output before the residual
  add, ``mlp_norm`` before the MLP and ``post_mlp_norm`` on its output;
- ``layer_types``: a ``sliding_attention`` layer sees the last ``sliding_window`` positions and rotates with
  base ``rope_local_base_freq``; a ``full_attention`` layer sees every position and rotates with base
  ``rope_theta`` (scaled linearly by ``rope_factor`` where ``rope_type`` is ``"linear"``). A sliding layer's KV
  cache holds ``min(sliding_window, max_seq_len)`` positions, a ring (:mod:`functional_npu.models.ring`); a full
  layer's ``max_seq_len``;
- scores scaled by ``query_pre_attn_scalar ** -0.5``; the MLP's gate is the tanh GELU;
- the embedding multiplied by ``sqrt(hidden_size)`` rounded to the params' dtype; tied embeddings by default;
- the logits soft-capped (``tanh(x / c) * c``) when ``final_logit_softcapping`` is set.

The full params, ``Params(tree, Gemma3Config)``::

    {"embed": [V, D], "norm": [D], "lm_head": [V, D] (untied only),
     "layers": [{"attn_norm": [D], "qkv": [(H+2K)*hd, D], "q_norm": [hd], "k_norm": [hd], "o_proj": [D, H*hd],
                 "post_attn_norm": [D], "mlp_norm": [D], "gate_up": [2F, D], "down": [D, F],
                 "post_mlp_norm": [D]}, ...]}

The layouts over the plan's ``tp`` are the Llama family's: ``[q|k|v]`` and ``[gate|up]`` column-parallel (KV
heads replicated when tp > num_kv_heads), ``o_proj`` and ``down`` row-parallel, the embedding and head
vocab-parallel, the norms replicated; module TP (the plan's ``module_tp``) as there.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..core.layout import Layout, fused, replicated, sharded
from ..core.mesh import Mesh
from ..core.schema import Field, read, show
from ..core.tree import register_static
from ..parallel.plan import Plan
from . import attention, dense, ring
from .attention import KV, Step, gqa
from .decoder import Blocks
from .embedding import embed, head, head_argmax
from .mlp import gated_mlp
from .rope_params import read_rope

__all__ = [
    "Gemma3Config",
    "ARCHITECTURES",
    "LAYER_TYPES",
    "HF_NAMES",
    "LINEARS",
    "LAYER_LEAVES",
    "NORM_OFFSET",
    "LayerAttention",
    "layer_attention",
    "abstract_params",
    "init_params",
    "param_specs",
    "prepare",
    "cache_len",
    "init_kv",
    "blocks",
]

ARCHITECTURES = ("Gemma3ForCausalLM",)
LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("default", "linear")  # of full_attention layers; sliding_attention layers rotate unscaled

# HF tensor names of each param leaf, in block order ({i}: layer index)
HF_NAMES: dict[str, list[str]] = {k: v for k, v in dense.HF_NAMES.items() if k != "qkv_bias"} | {
    "post_attn_norm": ["model.layers.{i}.post_attention_layernorm.weight"],
    "mlp_norm": ["model.layers.{i}.pre_feedforward_layernorm.weight"],
    "post_mlp_norm": ["model.layers.{i}.post_feedforward_layernorm.weight"],
}
LINEARS = dense.LINEARS
# the per-layer leaves that can be layer-sharded, in series order (the Llama family's names for the others)
LAYER_LEAVES = (
    "attn_norm", "qkv", "q_norm", "k_norm", "o_proj", "post_attn_norm", "mlp_norm", "gate_up", "down", "post_mlp_norm",
)  # fmt: skip
NORM_OFFSET = 1.0  # every norm scales by 1 + weight

# config.json beyond the sizes (dense.SIZES), as a schema (functional_npu.core.schema), with transformers' defaults
# for what it may leave out (Gemma3TextConfig); the rope parameters: functional_npu.models.rope_params
FIELDS = (
    Field("rms_norm_eps", "float", "the RMSNorm epsilon", default=1e-6, gt=0),
    Field("sliding_window", "int", "the sliding layers' window", default=4096, null=None, low=1),
    Field("sliding_window_pattern", "int", "every how many layers one is full", default=6, null=6, low=1),
    Field("layer_types", "str_list", "each layer's attention", default=None, null=None),
    Field("rope_theta", "float", "the full layers' rotary base", default=1_000_000.0, gt=0),
    Field("rope_local_base_freq", "float", "the sliding layers' rotary base", default=10_000.0, gt=0),
    Field("rope_parameters", "dict", "the rotary parameters by layer type", default=None, null=None),
    Field("rope_scaling", "dict", "the full layers' rope scaling", default=None, null=None),
    Field("query_pre_attn_scalar", "float", "the attention scores' scale", default=256, gt=0),
    Field("final_logit_softcapping", "float", "the logits' soft cap", default=None, null=None, gt=0),
    Field("max_position_embeddings", "int", "the longest sequence", default=131_072, low=1),
    Field("tie_word_embeddings", "bool", "lm_head shares the embedding", default=True, null=True),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemma3Config:
    """Static model config, read from a HF ``config.json`` by :meth:`from_hf`.

    ``rope_theta`` / ``rope_type`` / ``rope_factor`` are ``rope_parameters["full_attention"]``'s and
    ``rope_local_base_freq`` is ``rope_parameters["sliding_attention"]["rope_theta"]`` (the flat names older
    config.json files use).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope_theta: float
    rope_local_base_freq: float
    rope_type: str = "default"
    rope_factor: float = 1.0
    query_pre_attn_scalar: float = 256
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = True

    @staticmethod
    def from_hf(hf: Mapping[str, Any], where: str = "config.json") -> Gemma3Config:
        """Build from a parsed HF ``config.json`` (either rope form), checked against :data:`FIELDS`; one line
        naming ``where`` and the field for anything malformed or unsupported."""
        sizes = dense.read_sizes(hf, ARCHITECTURES, where)
        _refuse_unsupported(hf, where)
        v = read(hf, FIELDS, where=where, needs="a Gemma3ForCausalLM config")
        full, sliding = _rope_parameters(v, where)
        return Gemma3Config(
            **sizes,
            rms_norm_eps=float(v["rms_norm_eps"]),
            layer_types=_layer_types(v, sizes["num_layers"], where),
            sliding_window=v["sliding_window"],
            rope_theta=float(full["rope_theta"]),
            rope_local_base_freq=float(sliding["rope_theta"]),
            rope_type=full["rope_type"],
            rope_factor=float(full.get("factor", 1.0)),
            query_pre_attn_scalar=v["query_pre_attn_scalar"],
            final_logit_softcapping=v["final_logit_softcapping"],
            max_position_embeddings=v["max_position_embeddings"],
            tie_word_embeddings=v["tie_word_embeddings"],
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict for this config (read back by :meth:`from_hf` and by transformers)."""
        full: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "linear":
            full["factor"] = self.rope_factor
        return {
            **dense.write_sizes(self),
            "model_type": "gemma3_text",
            "rms_norm_eps": self.rms_norm_eps,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "rope_parameters": {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_local_base_freq},
            },
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "final_logit_softcapping": self.final_logit_softcapping,
            "attn_logit_softcapping": None,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
        }


register_static(Gemma3Config)


def _refuse_unsupported(hf: Mapping[str, Any], where: str) -> None:
    """Raise, in one line naming the field and a fix, on an option this family does not compute."""
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{where}: hidden_activation {act!r} is not supported; Gemma 3 uses 'gelu_pytorch_tanh'")
    if hf.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported (q/k/v/o_proj biases); set it to false")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(
            f"{where}: use_bidirectional_attention=true is not supported (decoding is causal); set it to false"
        )
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"{where}: attn_logit_softcapping={hf['attn_logit_softcapping']} is not supported: transformers' "
            f"Gemma 3 attention never applies it; set it to null to run as transformers does"
        )


def _layer_types(v: Mapping[str, Any], n: int, where: str) -> tuple[str, ...]:
    """``layer_types``, or (older configs) every ``sliding_window_pattern``-th layer full, the rest sliding."""
    pattern = v["sliding_window_pattern"]
    derived = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    types = derived if v["layer_types"] is None else v["layer_types"]  # [] is refused below, as transformers does
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ValueError(
            f"{where}: layer_types must give one of {LAYER_TYPES} for each of the num_hidden_layers={n} layers, got "
            f"{len(types)}: {show(types)}"
        )
    if "sliding_attention" in types and not v["sliding_window"]:
        raise ValueError(f"{where}: sliding_window is null but layer_types has sliding_attention layers; set it")
    return tuple(types)


def _rope_parameters(v: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(full_attention's, sliding_attention's)`` rope parameters as transformers reads them: ``rope_parameters``
    keyed by layer type, else (older configs) ``rope_theta`` + ``rope_scaling`` and ``rope_local_base_freq``."""
    given = v["rope_parameters"] or {}
    if set(given) - set(LAYER_TYPES):
        raise ValueError(
            f"{where}: rope_parameters must be keyed by layer type {LAYER_TYPES}, got keys {sorted(given)}; "
            f"give each layer type its own dict"
        )
    kinds = {
        "full_attention": ("rope_parameters.full_attention", ROPE_TYPES, v["rope_theta"]),
        "sliding_attention": ("rope_parameters.sliding_attention", ("default",), v["rope_local_base_freq"]),
    }
    out = []
    for kind, (path, allowed, theta) in kinds.items():
        raw = given.get(kind) or {}
        if kind == "full_attention" and v["rope_scaling"]:
            raw, path = dict(read(raw, (), where=where, prefix=path + ".")) | v["rope_scaling"], "rope_scaling"
        out.append(
            read_rope(raw, allowed, theta=theta, max_positions=v["max_position_embeddings"], where=where, path=path)
        )
        if raw.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"{where}: {path}.partial_rotary_factor={show(raw['partial_rotary_factor'])} is not supported; only "
                f"whole-head rotary (1.0) is"
            )
    return out[0], out[1]


# ---- attention per layer type -----------------------------------------------------------------
class LayerAttention(NamedTuple):
    """One layer type's rotary embedding and window, under the names :func:`attention.prepare` reads."""

    head_dim: int
    rope_theta: float
    rope_type: str
    rope_factor: float
    sliding_window: int | None


def layer_attention(cfg: Gemma3Config, layer_type: str) -> LayerAttention:
    """What a ``layer_type`` layer's attention shares with the others of its type."""
    if layer_type == "sliding_attention":
        return LayerAttention(cfg.head_dim, cfg.rope_local_base_freq, "default", 1.0, cfg.sliding_window)
    return LayerAttention(cfg.head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_factor, None)


def prepare(cfg: Gemma3Config, positions: torch.Tensor, kv: Mapping[str, KV], dtype: torch.dtype) -> dict[str, Step]:
    """Each layer type's step (its rotary embedding, its mask, its cache slots), computed once for all layers of the
    type; ``kv``: each layer type's first layer's cache. A windowed type's cache is a ring."""
    steps = {}
    for t, cache in kv.items():
        shared = layer_attention(cfg, t)
        make = attention.prepare if shared.sliding_window is None else ring.prepare
        steps[t] = make(shared, positions, cache, dtype)
    return steps


def cache_len(cfg: Gemma3Config, layer_type: str, max_seq_len: int) -> int:
    """The positions a ``layer_type`` layer's KV cache holds: a sliding layer's window (at most ``max_seq_len``),
    a full layer's ``max_seq_len``."""
    return ring.cache_len(layer_attention(cfg, layer_type).sliding_window, max_seq_len)


def init_kv(
    cfg: Gemma3Config, mesh: Mesh, batch: int, max_seq_len: int, dtype: torch.dtype, device: Any = None, *, tp: str
) -> list[KV]:
    """A zeroed KV cache on ``device``: per layer ``(k, v)`` of shape ``[batch, local KV heads, n, head_dim]``, ``n``
    the layer type's :func:`cache_len`."""
    _, heads = attention.local_heads(cfg, mesh.axis_size(tp))
    shapes = [(batch, heads, cache_len(cfg, t, max_seq_len), cfg.head_dim) for t in cfg.layer_types]
    return [(torch.zeros(s, dtype=dtype, device=device), torch.zeros(s, dtype=dtype, device=device)) for s in shapes]


# ---- the parallel plan ------------------------------------------------------------------------
def _layer_shapes(cfg: Gemma3Config) -> dict[str, tuple[int, ...]]:
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {
        "attn_norm": (d,),
        "qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, d),
        "q_norm": (hd,),
        "k_norm": (hd,),
        "o_proj": (d, cfg.num_heads * hd),
        "post_attn_norm": (d,),
        "mlp_norm": (d,),
        "gate_up": (2 * f, d),
        "down": (d, f),
        "post_mlp_norm": (d,),
    }


def abstract_params(
    cfg: Gemma3Config, plan: Plan = Plan(), dtype: torch.dtype = torch.float32, device: str | torch.device = "meta"
) -> dict[str, Any]:
    """The full (unsharded) params tree with empty tensors (on the meta device by default: no memory); no leaf
    depends on the plan."""
    return dense.dense_params(cfg, _layer_shapes(cfg), dtype, device)


def init_params(cfg: Gemma3Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Full params with seeded random weights (std 0.02; norms 0, which Gemma's ``1 + weight`` makes the identity)."""
    return dense.seeded(abstract_params(cfg), seed, dtype, norms=0.0)


def param_specs(cfg: Gemma3Config, plan: Plan = Plan()) -> dict[str, Any]:
    """The layouts of ``plan`` as a tree: the Llama family's, with the post-norms replicated. A module with module
    TP (``plan.module_tp``) is cut over its data-parallel axes and ``plan.tp``."""
    tp, mtp = plan.tp, plan.module_tp
    norms = ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")
    layer: dict[str, Layout] = {
        **dict.fromkeys(norms, replicated()),
        "qkv": fused(0, dense.qkv_blocks(cfg), tp),
        "o_proj": sharded(1, mtp.o_proj + (tp,)),
        **dense.gated_mlp_specs(cfg.intermediate_size, mtp.mlp + (tp,)),
    }
    return dense.with_ends(cfg, plan, [layer] * cfg.num_layers)


_GELU_TANH = functools.partial(F.gelu, approximate="tanh")  # transformers' gelu_pytorch_tanh


def blocks(cfg: Gemma3Config, plan: Plan = Plan()) -> Blocks:
    """The decoder's blocks: grouped-query attention (each layer with its type's step) and a tanh-GELU gated MLP
    in every layer, Gemma's norms, the scaled embedding and the soft-capped head."""
    tp_axis, mtp = plan.tp, plan.module_tp
    mlp = functools.partial(gated_mlp, tp=tp_axis, axes=mtp.mlp, activation=_GELU_TANH)
    head_args = {"tp": tp_axis, "eps": cfg.rms_norm_eps, "tied": cfg.tie_word_embeddings}
    head_args |= {"axes": dense.head_axes(cfg, plan), "norm_offset": NORM_OFFSET}
    head_args |= {"logit_softcap": cfg.final_logit_softcapping}
    return Blocks(
        embed=functools.partial(embed, tp=tp_axis, axes=mtp.embed, scale=cfg.hidden_size**0.5),
        prepare=functools.partial(prepare, cfg),
        attention=functools.partial(
            gqa, cfg=cfg, tp=tp_axis, axes=mtp.o_proj, scale=cfg.query_pre_attn_scalar**-0.5, norm_offset=NORM_OFFSET
        ),
        ffn=(mlp,) * cfg.num_layers,
        head=functools.partial(head, **head_args),
        argmax=functools.partial(head_argmax, **head_args),
        init_kv=functools.partial(init_kv, cfg, tp=tp_axis),
        eps=cfg.rms_norm_eps,
        norm_offset=NORM_OFFSET,
        layer_types=cfg.layer_types,
    )
