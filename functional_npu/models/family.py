"""The family table, and the one forward every family runs through.

A :class:`Family` is a plain record of a family's functions; the loader, compiler, graphs, runner
and CLI look the family up with :func:`family_of` (by HF architecture name or by config) and call
those functions, so no code outside ``models/`` names a family. :func:`forward` is the decoder
(:mod:`functional_npu.models.decoder`) over the family's blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..core.mesh import Mesh
from ..parallel.eplb import EXPERT_LEAVES
from ..parallel.module_tp import ModuleTP
from ..parallel.streams import INLINE, Streams
from . import deepseek, gemma3, llama, moe
from .decoder import Blocks, DecodeState, decode
from .deepseek import DeepseekConfig
from .gemma3 import Gemma3Config
from .llama import LlamaConfig
from .moe import MoeConfig

__all__ = ["Family", "FAMILIES", "ARCHITECTURES", "family_of", "forward", "init_state", "with_module_tp"]


@dataclass(frozen=True)
class Family:
    """One model family's functions.

    Attributes:
        from_hf: HF ``config.json`` dict -> config.
        hf_names: config -> {leaf: HF tensor names in block order} (``{i}``: layer, ``{j}``: expert).
        abstract_params / init_params: the full params tree, on the meta device / seeded random.
        param_specs: ``(cfg, tp_axis) ->`` the parallel plan, a tree of layouts.
        blocks: ``(cfg, tp_axis) ->`` the decoder's :class:`Blocks`.
        stacked: leaves whose dim 0 indexes experts, stored by HF as one tensor per expert ``{j}``.
        derived: leaf name -> function of the config giving a leaf that is computed, not stored.
        linears: leaves holding a linear layer's weight ``[..., out, in]`` (a quantized checkpoint may
            store them quantized; see :mod:`functional_npu.runtime.quant_plan`).
        module_names: config -> {leaf: the name a transformers model's ``state_dict()`` holds it under, as one
            tensor of the leaf's full shape} where that differs from ``hf_names`` (transformers' fused experts).
    """

    name: str
    config: type
    architectures: tuple[str, ...]
    from_hf: Callable[[Mapping[str, Any]], Any]
    hf_names: Callable[[Any], Mapping[str, list[str]]]
    abstract_params: Callable[..., dict]
    param_specs: Callable[..., dict]
    init_params: Callable[..., dict]
    blocks: Callable[..., Blocks]
    stacked: frozenset[str] = frozenset()
    derived: Mapping[str, Callable[[Any], Any]] | None = None
    linears: frozenset[str] = frozenset()
    module_names: Callable[[Any], Mapping[str, str]] = lambda cfg: {}


LLAMA = Family(
    "llama",
    LlamaConfig,
    llama.ARCHITECTURES,
    LlamaConfig.from_hf,
    lambda cfg: llama.HF_NAMES,
    llama.abstract_params,
    llama.param_specs,
    llama.init_params,
    llama.blocks,
    linears=frozenset(llama.LINEARS),
)
MOE = Family(
    "moe",
    MoeConfig,
    moe.ARCHITECTURES,
    MoeConfig.from_hf,
    moe.hf_names,
    moe.abstract_params,
    moe.param_specs,
    moe.init_params,
    moe.blocks,
    frozenset(EXPERT_LEAVES),
    {"expert_map": lambda cfg: moe.identity_map(cfg.num_experts)},
    frozenset(llama.LINEARS + moe.LINEARS),
    moe.module_names,
)
DEEPSEEK = Family(
    "deepseek",
    DeepseekConfig,
    deepseek.ARCHITECTURES,
    DeepseekConfig.from_hf,
    deepseek.hf_names,
    deepseek.abstract_params,
    deepseek.param_specs,
    deepseek.init_params,
    deepseek.blocks,
    frozenset(EXPERT_LEAVES),
    {"expert_map": lambda cfg: moe.identity_map(cfg.num_experts)},
    frozenset(deepseek.LINEARS),
    lambda cfg: moe.EXPERT_MODULES,
)
GEMMA3 = Family(
    "gemma3",
    Gemma3Config,
    gemma3.ARCHITECTURES,
    Gemma3Config.from_hf,
    lambda cfg: gemma3.HF_NAMES,
    gemma3.abstract_params,
    gemma3.param_specs,
    gemma3.init_params,
    gemma3.blocks,
    linears=frozenset(gemma3.LINEARS),
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


def with_module_tp(cfg: Any, plan: ModuleTP) -> Any:
    """``cfg`` with modules tensor-parallel over data-parallel axes (:mod:`functional_npu.parallel.module_tp`);
    an MoE config carries it in its attention / dense-MLP config."""
    family_of(cfg)
    if isinstance(cfg, MoeConfig):
        return replace(cfg, base=replace(cfg.base, module_tp=plan))
    return replace(cfg, module_tp=plan)


def forward(
    params: dict,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    state: DecodeState,
    mesh: Mesh,
    *,
    attention: str = "sdpa",
    tp_axis: str = "tp",
    streams: Streams = INLINE,
) -> torch.Tensor:
    """Logits ``[B, S, V]`` of any family's params; the contract (what is donated) is
    :mod:`~functional_npu.models.decoder`'s. ``streams`` are the compiler's ordering hints
    (:mod:`functional_npu.parallel.streams`; the backend supplies them).

    Example:
        >>> state = init_state(params["config"], mesh, batch=1, max_seq_len=64)     # doctest: +SKIP
        >>> logits = forward(params, tokens, positions, state, mesh)                # doctest: +SKIP
    """
    cfg = params["config"]
    return decode(
        params,
        tokens,
        positions,
        state,
        mesh,
        blocks=family_of(cfg).blocks(cfg, tp_axis),
        attention=attention,
        streams=streams,
    )


def init_state(
    cfg: Any, mesh: Mesh, batch: int, max_seq_len: int, dtype: torch.dtype = torch.float32, *, tp_axis: str = "tp"
) -> DecodeState:
    """A zeroed decode state: the KV cache for ``batch`` sequences of up to ``max_seq_len`` tokens, no prefetch."""
    return DecodeState(family_of(cfg).blocks(cfg, tp_axis).init_kv(mesh, batch, max_seq_len, dtype), [])
