"""The family table, and the one forward every family runs through.

A :class:`Family` is a plain record of a family's functions; the loader, compiler, graphs, runner
and CLI look the family up with :func:`family_of` (by HF architecture name or by config) and call
those functions, so no code outside ``models/`` names a family. :func:`forward` is the decoder
(:mod:`functional_npu.models.decoder`) over the family's blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.mesh import Mesh
from ..parallel.eplb_map import EXPERT_LEAVES
from ..parallel.layer_shard import LayerShard
from ..parallel.plan import EXPERT_FIELDS, MLA_FIELDS, Plan
from ..parallel.prefetch_ring import Ring, RingPhase
from ..parallel.streams import INLINE, Streams
from . import batch_invariant, deepseek, dense, gemma3, invariant, llama, moe
from .decoder import Blocks, DecodeState, decode
from .deepseek import DeepseekConfig
from .gemma3 import Gemma3Config
from .llama import LlamaConfig
from .moe import MoeConfig

__all__ = [
    "Family",
    "CostShape",
    "Megatron",
    "FAMILIES",
    "ARCHITECTURES",
    "family_of",
    "forward",
    "init_state",
    "series_leaves",
    "resolve_series",
    "plan_of",
    "check_invariant",
]


@dataclass(frozen=True)
class Megatron:
    """A family's Megatron-Core names and layouts (:mod:`functional_npu.interop.megatron`).

    Attributes:
        names: Megatron parameter name -> leaf path (``{i}``: layer index local to a pipeline chunk).
        aliases: other Megatron names for some of them -> the name in ``names`` (the local spec's norms).
        layouts: ``(cfg, plan) ->`` the leaves Megatron cuts unlike the family's ``param_specs``.
    """

    names: Mapping[str, str]
    aliases: Mapping[str, str]
    layouts: Callable[[Any, Plan], Mapping[str, Any]]


@dataclass(frozen=True)
class CostShape:
    """What a cost model reads of a config beyond the params' layouts (:mod:`~functional_npu.runtime.planning`).

    Attributes:
        hidden: the residual stream's width (each tensor-parallel reduction moves ``tokens x hidden``).
        vocab: the vocabulary (the head's logits).
        layers: decoder layers.
        attn_width: attention's output width, the input of ``o_proj`` (o_proj TP exchanges it).
        experts, top_k: routed experts and experts per token (0 for a dense model).
        moe_layers: the layers whose FFN is the routed experts.
        shared_experts: whether those layers also run a dense shared-experts MLP (tensor-parallel: one more
            reduction per layer).
    """

    hidden: int
    vocab: int
    layers: int
    attn_width: int
    experts: int = 0
    top_k: int = 0
    moe_layers: tuple[int, ...] = ()
    shared_experts: bool = False


def _dense_cost(cfg: Any) -> CostShape:
    return CostShape(cfg.hidden_size, cfg.vocab_size, cfg.num_layers, cfg.num_heads * cfg.head_dim)


def _moe_cost(cfg: MoeConfig) -> CostShape:
    width = cfg.num_heads * cfg.head_dim
    return CostShape(
        cfg.hidden_size, cfg.vocab_size, cfg.num_layers, width, cfg.num_experts, cfg.top_k, cfg.moe_layers,
        shared_experts=bool(cfg.shared_intermediate_size),
    )  # fmt: skip


def _deepseek_cost(cfg: DeepseekConfig) -> CostShape:
    width = cfg.num_heads * cfg.v_head_dim
    return CostShape(
        cfg.hidden_size, cfg.vocab_size, cfg.num_layers, width, cfg.num_experts, cfg.top_k, cfg.moe_layers,
        shared_experts=bool(cfg.n_shared_experts),
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model family's functions.

    Attributes:
        from_hf: ``(HF config.json dict, where="config.json") ->`` config, checked against the family's schema
            (:mod:`functional_npu.core.schema`; one line naming ``where`` and the field for anything malformed).
        hf_names: config -> {leaf: HF tensor names in block order} (``{i}``: layer, ``{j}``: expert).
        abstract_params / init_params: the full params tree, on the meta device / seeded random.
        abstract_params: ``(cfg, plan) ->`` the full params on the meta device (expert slots are the plan's).
        param_specs: ``(cfg, plan) ->`` the plan's layouts, a tree (:class:`~functional_npu.parallel.plan.Plan`).
        blocks: ``(cfg, plan) ->`` the decoder's :class:`Blocks`.
        stacked: leaves whose dim 0 indexes experts, stored by HF as one tensor per expert ``{j}``.
        derived: leaf name -> function of the config giving a leaf that is computed, not stored.
        linears: leaves holding a linear layer's weight ``[..., out, in]`` (a quantized checkpoint may
            store them quantized; see :mod:`functional_npu.placement.quant_layouts`).
        module_names: config -> {leaf: the name a transformers model's ``state_dict()`` holds it under, as one
            tensor of the leaf's full shape} where that differs from ``hf_names`` (transformers' fused experts).
        plan_fields: the plan fields this family reads beyond every family's (tp, module TP, layer sharding):
            a plan setting another is refused (:func:`functional_npu.placement.check.check_plan`).
        layer_leaves: the per-layer leaves that can be layer-sharded, in series order (the order a layer's
            series travel in); ``series_aliases``: other names users give some of them (``down_proj``).
        megatron: the family's Megatron-Core names and layouts (``None``: not known).
        sizes: config -> the sizes that fix tensor shapes, by field name (named in the loader's shape errors).
        unread: config -> name prefixes of tensors a checkpoint stores that the model does not run.
        cost: config -> the sizes the planner's cost model reads (:class:`CostShape`; ``None``: no cost rules yet).
        buffers: float leaves the forward reads that no gradient trains (transformers keeps them as buffers:
            DeepSeek-V3's routing correction bias is moved by a balancing rule, not by the loss).
        not_invariant: the ops of this family's forward that have no invariant form yet (``Plan.invariant`` is
            refused naming them); ``None``: its blocks run the invariant mode (:mod:`functional_npu.models.invariant`).
        npu_invariant: whether its invariant forward's NPU graphs (torchair's GE graph, npugraph_ex's ACL graph) are
            checked to hold only the invariant functions' ops (graphs/*-invariant-*): the NPU backends run it then.
    """

    name: str
    config: type
    architectures: tuple[str, ...]
    from_hf: Callable[..., Any]
    hf_names: Callable[[Any], Mapping[str, list[str]]]
    abstract_params: Callable[..., dict]
    param_specs: Callable[..., dict]
    init_params: Callable[..., dict]
    blocks: Callable[..., Blocks]
    stacked: frozenset[str] = frozenset()
    derived: Mapping[str, Callable[[Any], Any]] | None = None
    linears: frozenset[str] = frozenset()
    module_names: Callable[[Any], Mapping[str, str]] = lambda cfg: {}
    plan_fields: frozenset[str] = frozenset()
    sizes: Callable[[Any], Mapping[str, Any]] = lambda cfg: {}
    unread: Callable[[Any], tuple[str, ...]] = lambda cfg: ()
    layer_leaves: tuple[str, ...] = ()
    series_aliases: Mapping[str, tuple[str, ...]] | None = None
    megatron: Megatron | None = None
    cost: Callable[[Any], CostShape] | None = None
    buffers: frozenset[str] = frozenset()
    not_invariant: str | None = None
    npu_invariant: bool = False


def _functions(module: Any) -> dict[str, Any]:
    """A family module's params, layouts and blocks (every family module defines them by these names)."""
    names = ("abstract_params", "param_specs", "init_params", "blocks")
    return {name: getattr(module, name) for name in names}


# what every family with experts declares: experts stacked on dim 0, the expert map computed, not stored
_EXPERTS: dict[str, Any] = {
    "stacked": frozenset(EXPERT_LEAVES),
    "derived": {"expert_map": lambda cfg: moe.identity_map(cfg.num_experts)},
}

LLAMA = Family(
    name="llama",
    config=LlamaConfig,
    architectures=llama.ARCHITECTURES,
    from_hf=LlamaConfig.from_hf,
    hf_names=lambda cfg: llama.HF_NAMES,
    **_functions(llama),
    linears=frozenset(llama.LINEARS),
    sizes=lambda cfg: {f: getattr(cfg, f) for f in llama.SIZE_FIELDS},
    layer_leaves=llama.LAYER_LEAVES,
    series_aliases=llama.SERIES_ALIASES,
    megatron=Megatron(llama.MEGATRON_NAMES, llama.MEGATRON_ALIASES, llama.megatron_layouts),
    cost=_dense_cost,
    npu_invariant=True,  # graphs/qwen3-tp*-invariant-*
)
MOE = Family(
    name="moe",
    config=MoeConfig,
    architectures=moe.ARCHITECTURES,
    from_hf=MoeConfig.from_hf,
    hf_names=moe.hf_names,
    **_functions(moe),
    **_EXPERTS,
    linears=frozenset(dense.LINEARS + moe.LINEARS),
    module_names=moe.module_names,
    plan_fields=frozenset(EXPERT_FIELDS),
    sizes=moe.sizes,
    layer_leaves=dense.LAYER_LEAVES,
    series_aliases=dense.SERIES_ALIASES,
    cost=_moe_cost,
)
DEEPSEEK = Family(
    name="deepseek",
    config=DeepseekConfig,
    architectures=deepseek.ARCHITECTURES,
    from_hf=DeepseekConfig.from_hf,
    hf_names=deepseek.hf_names,
    **_functions(deepseek),
    **_EXPERTS,
    linears=frozenset(deepseek.LINEARS),
    module_names=lambda cfg: moe.EXPERT_MODULES,
    plan_fields=frozenset(EXPERT_FIELDS + MLA_FIELDS),
    sizes=lambda cfg: {f: getattr(cfg, f) for f in deepseek.SIZE_FIELDS},
    unread=deepseek.unread,
    layer_leaves=deepseek.LAYER_LEAVES,
    series_aliases=deepseek.SERIES_ALIASES,
    cost=_deepseek_cost,
    buffers=frozenset({"router_bias"}),
)
GEMMA3 = Family(
    name="gemma3",
    config=Gemma3Config,
    architectures=gemma3.ARCHITECTURES,
    from_hf=Gemma3Config.from_hf,
    hf_names=lambda cfg: gemma3.HF_NAMES,
    **_functions(gemma3),
    linears=frozenset(gemma3.LINEARS),
    sizes=lambda cfg: {f: getattr(cfg, f) for f in dense.SIZE_FIELDS},
    layer_leaves=gemma3.LAYER_LEAVES,
    series_aliases=dense.SERIES_ALIASES,
    cost=_dense_cost,
    not_invariant="the tanh of its GELU and of its logit soft-capping",
)
FAMILIES = (LLAMA, MOE, DEEPSEEK, GEMMA3)
ARCHITECTURES = tuple(a for f in FAMILIES for a in f.architectures)


def family_of(config_or_architecture: Any) -> Family:
    """The family of a config object or a HF architecture name.

    Raises:
        ValueError for an unknown architecture, TypeError for an object that is not a model config.
    """
    for f in FAMILIES:
        if isinstance(config_or_architecture, f.config) or config_or_architecture in f.architectures:
            return f
    if isinstance(config_or_architecture, str) or config_or_architecture is None:
        raise ValueError(f"unsupported architecture {config_or_architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    raise TypeError(
        f"{type(config_or_architecture).__name__} is not a model config; "
        f"expected one of {[f.config.__name__ for f in FAMILIES]}"
    )


def series_leaves(cfg: Any, ls: LayerShard, plan: Plan = Plan(), layers: Sequence[Mapping] | None = None) -> LayerShard:
    """``ls`` with its series names resolved for ``cfg``: each a leaf every layer has, in the family's series
    order. A leaf name stands for itself, an alias for its leaves (``down_proj``: ``down``; ``q_proj``: the fused
    ``qkv`` and its bias), ``layer`` for every per-layer leaf every layer has. ``layers``: the per-layer params
    (abstract) of ``cfg`` under ``plan`` when the caller has them (else built here).

    Raises:
        ValueError naming a series this model does not have (with the ones it has), or one some layers lack.
    """
    return LayerShard(ls.axis, resolve_series(cfg, ls.leaves, plan, layers))


def resolve_series(
    cfg: Any, wanted: Sequence[str], plan: Plan = Plan(), layers: Sequence[Mapping] | None = None, *, field: str = ""
) -> tuple[str, ...]:
    """Series names resolved to leaves as :func:`series_leaves` does, for the plan field ``field`` (``layer_shard``,
    the default, or ``offload``), whose name starts the errors."""
    what, verb = (field, field) if field else ("layer_shard", "layer-shard")
    family = family_of(cfg)
    layers = family.abstract_params(cfg, plan)["layers"] if layers is None else layers
    every = tuple(leaf for leaf in family.layer_leaves if all(leaf in layer for layer in layers))
    names = {leaf: (leaf,) for leaf in family.layer_leaves} | dict(family.series_aliases or {}) | {"layer": every}
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise ValueError(f"{what}: a {cfg.architecture} has no series {unknown}; choose from {', '.join(names)}")
    lacking = [n for n in wanted if not set(names[n]) & set(every)]
    if lacking:
        raise ValueError(
            f"{what}: series {lacking} are not in every layer of this {cfg.architecture}; "
            f"{verb} some of {', '.join(every)}"
        )
    chosen = {leaf for n in wanted for leaf in names[n]}
    return tuple(leaf for leaf in every if leaf in chosen)


def forward(
    params: dict,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    state: DecodeState,
    mesh: Mesh,
    last: torch.Tensor | None = None,
    *,
    attention: str = "sdpa",
    plan: Plan | None = None,
    streams: Streams = INLINE,
    differentiable: bool = False,
    ring: Ring | None = None,
) -> torch.Tensor:
    """Logits ``[B, S, V]`` of any family's params (``[B, 1, V]`` at ``last [B]``, one position of each row); the
    contract (what is donated) is :mod:`~functional_npu.models.decoder`'s. ``plan``: the plan the params were sharded
    by (default: :func:`plan_of` the params). ``streams`` are the compiler's ordering hints
    (:mod:`functional_npu.parallel.streams`; the backend supplies them). ``differentiable``: the forward a gradient is
    taken of (layer-sharded weights by differentiable broadcasts; :mod:`functional_npu.runtime.training.grad`).
    ``ring``: the prefetch ring's layout, answered once (:func:`~functional_npu.parallel.prefetch_ring.ring_of`; None:
    answered from the params and ``plan``).

    Example:
        >>> state = init_state(params.config, mesh, batch=1, max_seq_len=64)        # doctest: +SKIP
        >>> logits = forward(params, tokens, positions, state, mesh)                # doctest: +SKIP
    """
    cfg, plan = params.config, plan_of(params) if plan is None else plan
    check_invariant(params, plan, "forward")
    return decode(
        params,
        tokens,
        positions,
        state,
        mesh,
        last,
        blocks=family_of(cfg).blocks(cfg, plan),
        plan=plan,
        attention=attention,
        streams=streams,
        differentiable=differentiable,
        ring=ring,
    )


def check_invariant(params: dict, plan: Plan, where: str) -> None:
    """Refuse ``plan.invariant`` for params whose forward has an op without an invariant form, naming the op: a
    family's (:attr:`Family.not_invariant`), quantized kernels, module TP's exchanges, a dtype the invariant
    functions do not compute in."""
    if not plan.invariant:
        return
    check_invariant_model(params.config, getattr(params.placement, "quant", None), plan, where)
    if plan.invariant == "batch":
        dtype = params["embed"].dtype
        if dtype not in batch_invariant.DTYPES:
            raise ValueError(
                f"{where}: Plan.invariant='batch': its pinned kernels are measured in float32 and bfloat16, not "
                f"{dtype}; load the params in one of those, or use Plan(invariant='portable')"
            )
        return
    invariant.check_dtype(params["embed"].dtype, where)


def check_invariant_model(cfg: Any, quant: Any, plan: Plan, where: str) -> None:
    """:func:`check_invariant`'s checks that need no weights (the family, a sliding window, quantization, module
    TP): a command line runs them before any rank starts."""
    if not plan.invariant:
        return
    gap = family_of(cfg).not_invariant
    if gap is not None:
        raise ValueError(
            f"{where}: Plan.invariant: {cfg.architecture} has no invariant form of {gap} yet; leave Plan.invariant "
            f"off for this model (the dense, MoE and DeepSeek families run it: Llama / Mistral / Qwen2 / Qwen3, "
            f"Qwen3-MoE / Qwen2-MoE / Mixtral, DeepSeek-V2 / V3)"
        )
    if getattr(cfg, "sliding_window", None) is not None:
        raise ValueError(
            f"{where}: Plan.invariant: a sliding window ({cfg.sliding_window}) keeps its keys in a ring cache, in "
            f"another order than the training forward's; the invariant mode runs full attention only"
        )
    if quant is not None:
        raise ValueError(
            f"{where}: Plan.invariant: the quantized matmul kernels ({quant.quant}) reduce in an order of their own; "
            f"load the checkpoint unquantized (dtype float32 or bfloat16) to run the invariant mode"
        )
    if plan.module_tp:
        raise ValueError(
            f"{where}: Plan.invariant: module TP ({dict(plan.module_tp.items())}) sums partial products by "
            f"reduce_scatter, which has no invariant form yet; drop module_tp or leave Plan.invariant off"
        )


def plan_of(params: dict) -> Plan:
    """The plan ``params`` were sharded by: their placement's (``params.placement.plan``, as ``load_checkpoint``
    leaves it), or for params that carry none (``shard`` of a family's full params by its default layouts) the
    default plan. The one rule every consumer reads it by."""
    own = getattr(params, "placement", None)
    return Plan() if own is None else own.plan


def init_state(
    cfg: Any,
    mesh: Mesh,
    batch: int,
    max_seq_len: int,
    dtype: torch.dtype = torch.float32,
    *,
    plan: Plan = Plan(),
    device: Any = None,
) -> DecodeState:
    """A zeroed decode state on ``device``: the KV cache for ``batch`` sequences of up to ``max_seq_len`` tokens, no
    prefetch."""
    return DecodeState(
        family_of(cfg).blocks(cfg, plan).init_kv(mesh, batch, max_seq_len, dtype, device), [], RingPhase()
    )
