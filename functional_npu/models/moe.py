"""Mixture-of-experts families: Qwen3-MoE, Qwen2-MoE (with its gated shared expert) and Mixtral, with expert
parallelism.

Attention, embeddings and norms are the dense decoder's (:mod:`.dense`); an MoE layer's FFN is the experts block of
:mod:`functional_npu.models.experts` (a router and experts stacked over ``S`` physical slots, with an
``expert_map`` from logical experts to slots), and the other layers keep the dense gated MLP. The
expert-parallel choices are the plan's (:class:`functional_npu.parallel.plan.Plan`: ``expert_axes``,
``num_slots``, ``max_copies``, ``dispatch_threshold``): experts are sharded on dim 0 over the expert axes
(e.g. ``("dp", "tp")``: each rank holds ``S / ep`` consecutive slots) and, when the tensor-parallel
axis is not one of them, each expert is also tensor-parallel over it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core.dtypes import float_dtype
from ..core.layout import replicated
from ..core.schema import REQUIRED, Field, Rule, read
from ..core.tree import map_with_path, register_static
from ..parallel.plan import Plan
from .decoder import Blocks
from .dense import HF_NAMES, architecture, dense_params, layer_shapes, read_dense, write_dense
from .dense import SIZE_FIELDS as DENSE_SIZES
from .dense import blocks as dense_blocks
from .dense import param_specs as dense_specs
from .experts import Routing, expert_specs, identity_map, moe_ffn

__all__ = [
    "MoeConfig",
    "ARCHITECTURES",
    "hf_names",
    "module_names",
    "EXPERT_MODULES",
    "LINEARS",
    "SIZE_FIELDS",
    "sizes",
    "abstract_params",
    "init_params",
    "param_specs",
    "blocks",
    "identity_map",
]

# architecture -> (the dense sibling whose attention it shares, HF model_type)
_SIBLING = {
    "Qwen3MoeForCausalLM": ("Qwen3ForCausalLM", "qwen3_moe"),
    "MixtralForCausalLM": ("MistralForCausalLM", "mixtral"),
    "Qwen2MoeForCausalLM": ("Qwen2ForCausalLM", "qwen2_moe"),
}
ARCHITECTURES = tuple(_SIBLING)

SIZE_FIELDS = ("num_experts", "moe_intermediate_size")  # beside the dense decoder's (dense.SIZE_FIELDS)
# the leaves that are linear layers' weights ([..., out, in]; the experts stacked on dim 0)
LINEARS = ("router", "experts_gate_up", "experts_down", "shared_gate_up", "shared_down")


# ---- config.json, as a schema (functional_npu.core.schema), beside the dense decoder's (dense.SIZES, dense.FIELDS)
def schema(arch: str, hf: Mapping[str, Any]) -> tuple[tuple[Field, ...], tuple[Rule, ...]]:
    """The fields and rules of an ``arch`` config's experts. The expert count is Mixtral's ``num_local_experts``
    or the Qwen families' ``num_experts``; either name is read where the other is not given."""
    count = "num_local_experts" if arch == "MixtralForCausalLM" else "num_experts"
    other = "num_experts" if arch == "MixtralForCausalLM" else "num_local_experts"
    count = other if hf.get(count) is None and hf.get(other) is not None else count
    qwen = arch != "MixtralForCausalLM"
    fields = (
        Field("num_hidden_layers", "int", "the number of decoder layers", low=1),
        Field(count, "int", "the number of routed experts", low=1),
        Field("num_experts_per_tok", "int", "the experts each token is routed to", low=1),
        Field("moe_intermediate_size", "int", "each expert's MLP width", low=1, default=REQUIRED if qwen else 0),
        Field("norm_topk_prob", "bool", "renormalize the top-k weights", default=False, null=False),
        Field("decoder_sparse_step", "int", "every how many layers one is MoE", default=1, null=1, low=1),
        Field("mlp_only_layers", "int_list", "the layers with a dense MLP", default=[], null=[]),
        Field(
            "shared_expert_intermediate_size",
            "int",
            "the shared expert's MLP width (Qwen2-MoE)",
            default=0,
            null=0,
            low=0,
            choices=() if arch == "Qwen2MoeForCausalLM" else (0,),
        ),
        Field("qkv_bias", "bool", "biases on q/k/v (Qwen2-MoE)", default=True, null=True),
    )
    rules = (
        Rule(
            ("num_experts_per_tok", count),
            lambda v: v["num_experts_per_tok"] <= v[count],
            "{num_experts_per_tok} experts per token is more than the model's {%s} experts; lower "
            "num_experts_per_tok" % count,
        ),
        Rule(
            ("mlp_only_layers", "num_hidden_layers"),
            lambda v: all(0 <= i < v["num_hidden_layers"] for i in v["mlp_only_layers"]),
            "{mlp_only_layers} names layers outside the model's {num_hidden_layers}; give indices from 0 to "
            "num_hidden_layers - 1",
        ),
    )
    return fields, rules


_EXPERT_NAMES = {
    "Qwen3MoeForCausalLM": {
        "router": ["model.layers.{i}.mlp.gate.weight"],
        "experts_gate_up": [
            "model.layers.{i}.mlp.experts.{j}.gate_proj.weight",
            "model.layers.{i}.mlp.experts.{j}.up_proj.weight",
        ],
        "experts_down": ["model.layers.{i}.mlp.experts.{j}.down_proj.weight"],
    },
    "Qwen2MoeForCausalLM": {
        "router": ["model.layers.{i}.mlp.gate.weight"],
        "experts_gate_up": [
            "model.layers.{i}.mlp.experts.{j}.gate_proj.weight",
            "model.layers.{i}.mlp.experts.{j}.up_proj.weight",
        ],
        "experts_down": ["model.layers.{i}.mlp.experts.{j}.down_proj.weight"],
        "shared_gate_up": [
            "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
            "model.layers.{i}.mlp.shared_expert.up_proj.weight",
        ],
        "shared_down": ["model.layers.{i}.mlp.shared_expert.down_proj.weight"],
        "shared_gate": ["model.layers.{i}.mlp.shared_expert_gate.weight"],
    },
    "MixtralForCausalLM": {
        "router": ["model.layers.{i}.block_sparse_moe.gate.weight"],
        "experts_gate_up": [
            "model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight",
            "model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight",
        ],
        "experts_down": ["model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight"],
    },
}


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeConfig:
    """Static config of an MoE model (what its ``config.json`` says; the placement is the plan's): the dense
    decoder's fields (:class:`~functional_npu.models.dense.DenseConfig`: attention, embeddings, the dense layers'
    MLP) and the experts'.

    Attributes:
        architecture: "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM" or "MixtralForCausalLM".
        num_experts: logical experts ``E``; top_k: experts per token.
        moe_intermediate_size: each expert's ``F``.
        norm_topk_prob: renormalize the top-k probabilities (always for Mixtral).
        moe_layers: indices of the MoE layers (the others have a dense MLP of ``intermediate_size``).
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
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]
    routing: Routing = Routing()  # softmax top-k (every family here)
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (gated by sigmoid(h @ shared_gate.T))

    @staticmethod
    def from_hf(hf: Mapping[str, Any], where: str = "config.json") -> MoeConfig:
        """Build from a parsed HF ``config.json`` (an architecture of :data:`ARCHITECTURES`): the dense fields as
        its dense sibling reads them (:func:`~functional_npu.models.dense.read_dense`), the experts' checked against
        :func:`schema` (one line naming ``where`` and the field for anything malformed)."""
        arch = architecture(hf, ARCHITECTURES, where)
        base = read_dense(hf, _SIBLING[arch][0], where)
        fields, rules = schema(arch, hf)
        v = read(hf, fields, rules, where=where, needs=f"a {arch} config")
        experts, top_k, shared = v[fields[1].key], v["num_experts_per_tok"], v["shared_expert_intermediate_size"]
        if arch == "Qwen2MoeForCausalLM":
            base["qkv_bias"] = v["qkv_bias"]
        if arch == "MixtralForCausalLM":
            every = tuple(range(base["num_layers"]))
            moe = {"moe_intermediate_size": base["intermediate_size"], "norm_topk_prob": True, "moe_layers": every}
        else:
            step, dense = v["decoder_sparse_step"], set(v["mlp_only_layers"])
            layers = tuple(i for i in range(base["num_layers"]) if i not in dense and (i + 1) % step == 0)
            moe = {
                "moe_intermediate_size": v["moe_intermediate_size"],
                "norm_topk_prob": v["norm_topk_prob"],
                "moe_layers": layers,
                "shared_intermediate_size": shared,
            }
        return MoeConfig(architecture=arch, **base, num_experts=experts, top_k=top_k, **moe)

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (read back by :meth:`from_hf`)."""
        out = write_dense(self) | {
            "model_type": _SIBLING[self.architecture][1],
            "num_experts_per_tok": self.top_k,
        }
        if self.architecture == "MixtralForCausalLM":
            return out | {"num_local_experts": self.num_experts}
        dense = [i for i in range(self.num_layers) if i not in self.moe_layers]
        out |= {
            "num_experts": self.num_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": dense,
        }
        if self.architecture == "Qwen2MoeForCausalLM":
            out |= {"shared_expert_intermediate_size": self.shared_intermediate_size, "qkv_bias": self.qkv_bias}
        return out


register_static(MoeConfig)


def sizes(cfg: MoeConfig) -> dict[str, int]:
    """The config's sizes that fix tensor shapes: the attention's and the experts'."""
    return {f: getattr(cfg, f) for f in DENSE_SIZES + SIZE_FIELDS}


def hf_names(cfg: MoeConfig) -> dict[str, list[str]]:
    """HF tensor names of each param leaf in block order (``{i}``: layer, ``{j}``: expert); expert_map is computed."""
    return {**HF_NAMES, **_EXPERT_NAMES[cfg.architecture], "expert_map": []}


# transformers (5 and later) holds each layer's experts in memory as two tensors in the leaves' own shapes and
# block order ([E, gate|up, D] and [E, D, F]), saved and loaded as one tensor per expert
EXPERT_MODULES = {
    "experts_gate_up": "model.layers.{i}.mlp.experts.gate_up_proj",
    "experts_down": "model.layers.{i}.mlp.experts.down_proj",
}


def module_names(cfg: MoeConfig) -> dict[str, str]:
    """The ``state_dict()`` names of a transformers model's leaves where they differ from the checkpoint's
    (``{i}``: layer): the stacked experts, and Mixtral's router (``mlp``, saved as ``block_sparse_moe``)."""
    router = {"router": "model.layers.{i}.mlp.gate.weight"} if cfg.architecture == "MixtralForCausalLM" else {}
    return EXPERT_MODULES | router


# ---- the parallel plan ------------------------------------------------------------------------
def _moe_shapes(cfg: MoeConfig, plan: Plan) -> dict[str, tuple[int, ...]]:
    d, f, s = cfg.hidden_size, cfg.moe_intermediate_size, plan.slots(cfg.num_experts)
    shapes = {"router": (cfg.num_experts, d), "experts_gate_up": (s, 2 * f, d), "experts_down": (s, d, f)}
    if cfg.shared_intermediate_size:
        fs = cfg.shared_intermediate_size
        shapes |= {"shared_gate_up": (2 * fs, d), "shared_down": (d, fs), "shared_gate": (1, d)}
    return shapes


def abstract_params(
    cfg: MoeConfig, plan: Plan = Plan(), dtype: torch.dtype = torch.float32, device: str | torch.device = "meta"
) -> dict[str, Any]:
    """The full (unsharded) params tree with empty tensors (on the meta device by default), with the plan's
    expert slots and copies."""
    dense = dense_params(cfg, layer_shapes(cfg), dtype, device)
    layers = []
    for i, layer in enumerate(dense["layers"]):
        if i in cfg.moe_layers:
            layer = {k: v for k, v in layer.items() if k not in ("gate_up", "down")}
            layer |= {k: torch.empty(v, dtype=dtype, device=device) for k, v in _moe_shapes(cfg, plan).items()}
            layer["expert_map"] = torch.empty((cfg.num_experts, plan.max_copies), dtype=torch.int64, device=device)
        layers.append(layer)
    return dense | {"layers": layers}


def init_params(cfg: MoeConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Full params with seeded random weights (std 0.02, norms 1) and the identity expert map (one slot
    per expert)."""
    dtype = float_dtype(dtype, "init_params")
    g = torch.Generator().manual_seed(seed)

    def fill(path: str, x: torch.Tensor) -> torch.Tensor:
        if path.endswith("expert_map"):
            return identity_map(cfg.num_experts)
        if path.endswith("norm"):
            return torch.ones(x.shape, dtype=dtype)
        return (torch.randn(x.shape, generator=g) * 0.02).to(dtype)

    return map_with_path(fill, abstract_params(cfg))


def param_specs(cfg: MoeConfig, plan: Plan = Plan()) -> dict[str, Any]:
    """The layouts: attention and dense MLPs as the dense decoder's; experts over ``plan.expert_axes`` (and
    ``plan.tp`` inside)."""
    dense = dense_specs(cfg, plan)
    moe = expert_specs(cfg, plan, cfg.shared_intermediate_size)
    if cfg.shared_intermediate_size:  # Qwen2-MoE's shared expert is gated
        moe["shared_gate"] = replicated()
    layers = []
    for i, layer in enumerate(dense["layers"]):
        if i in cfg.moe_layers:
            layer = {k: v for k, v in layer.items() if k not in ("gate_up", "down")} | moe
        layers.append(layer)
    return dense | {"layers": layers}


def blocks(cfg: MoeConfig, plan: Plan = Plan()) -> Blocks:
    """The dense decoder's blocks with the experts block as the FFN of every MoE layer."""
    dense = dense_blocks(cfg, plan)
    experts = functools.partial(moe_ffn, cfg=cfg, plan=plan)
    ffn = tuple(experts if i in cfg.moe_layers else mlp for i, mlp in enumerate(dense.ffn))
    return dataclasses.replace(dense, ffn=ffn)
