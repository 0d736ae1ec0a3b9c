"""Model families as pure forward functions over param pytrees, and the table that picks one by architecture.

A :class:`Family` is a plain record of a family's functions; loader, compiler, graphs, runner and
CLI look the family up with :func:`family_of` (by HF architecture name or by config) and call
those functions, so no code outside ``models/`` names a family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import llama
from . import moe
from .llama import ARCHITECTURES as _DENSE
from .llama import LlamaConfig
from .moe import MoeConfig


@dataclass(frozen=True)
class Family:
    """One model family's functions (see ``models/llama.py`` for the contract of each).

    Attributes:
        stacked: leaves whose dim 0 indexes experts, stored by HF as one tensor per expert ``{j}``.
        derived: leaf name -> function of the config giving a leaf that is computed, not stored.
    """

    name: str
    config: type
    architectures: tuple[str, ...]
    from_hf: Callable[[Mapping[str, Any]], Any]
    hf_names: Callable[[Any], Mapping[str, list[str]]]
    abstract_params: Callable[..., dict]
    param_specs: Callable[[Any], dict]
    init_params: Callable[..., dict]
    forward: Callable[..., Any]
    init_cache: Callable[..., list]
    stacked: frozenset[str] = frozenset()
    derived: Mapping[str, Callable[[Any], Any]] | None = None


LLAMA = Family("llama", LlamaConfig, _DENSE, LlamaConfig.from_hf, lambda cfg: llama.HF_NAMES, llama.abstract_params,
               llama.param_specs, llama.init_params, llama.forward, llama.init_cache)
MOE = Family("moe", MoeConfig, moe.ARCHITECTURES, MoeConfig.from_hf, moe.hf_names, moe.abstract_params, moe.param_specs,
             moe.init_params, moe.forward, moe.init_cache, moe.EXPERT_LEAVES, {"expert_map": lambda cfg: moe.identity_map(cfg.num_experts)})
FAMILIES = (LLAMA, MOE)
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
    raise TypeError(f"{type(config_or_architecture).__name__} is not a model config; expected one of {[f.config.__name__ for f in FAMILIES]}")


__all__ = ["llama", "moe", "LlamaConfig", "MoeConfig", "ARCHITECTURES", "Family", "FAMILIES", "family_of"]
