"""Model families over one decoder: building blocks, the layer loop, and the table that picks a family.

* blocks: :mod:`.embedding` (vocab-parallel embedding, final norm + head), :mod:`.attention`
  (grouped-query attention with rotary embeddings and its KV cache, ``sdpa`` / ``math`` kinds),
  :mod:`.mlp` (gated MLP), :mod:`.experts` (mixture-of-experts FFN with expert parallelism);
* :mod:`.decoder`: the params form, :class:`DecodeState` and the one layer loop;
* :mod:`.dense`: the dense decoder every family builds on (its config fields, params, layouts and blocks);
* families: :mod:`.llama` (Llama, Mistral, Qwen2, Qwen3), :mod:`.moe` (Qwen3-MoE, Mixtral),
  :mod:`.deepseek` (DeepSeek-V2/V3), :mod:`.gemma3` (Gemma 3 text): a config, HF names, a parallel plan
  and a choice of blocks each;
* :mod:`.family`: :func:`family_of` and the :func:`forward` every family runs through;
* the invariant modes (:mod:`.invariant_modes`): :mod:`.batch_invariant` (the fast kernels, their orders pinned)
  and :mod:`.invariant` / :mod:`.invariant_ops` (portable: trees of adds and polynomials).
"""

from . import batch_invariant, deepseek, dense, gemma3, invariant, invariant_modes, invariant_ops, llama, moe
from .ascend_ops import NPU_KERNELS
from .decoder import Blocks, DecodeState
from .deepseek import DeepseekConfig
from .embedded import embedded_config
from .experts import Routing
from .family import (
    ARCHITECTURES,
    FAMILIES,
    Family,
    check_invariant,
    check_invariant_model,
    family_of,
    forward,
    init_state,
    plan_of,
    resolve_series,
    series_leaves,
)
from .gemma3 import Gemma3Config
from .linear import prepare_params, streamed
from .llama import LlamaConfig
from .moe import MoeConfig

__all__ = [
    "NPU_KERNELS",
    "deepseek",
    "dense",
    "gemma3",
    "llama",
    "moe",
    "LlamaConfig",
    "MoeConfig",
    "DeepseekConfig",
    "Gemma3Config",
    "ARCHITECTURES",
    "Family",
    "FAMILIES",
    "family_of",
    "forward",
    "init_state",
    "series_leaves",
    "resolve_series",
    "plan_of",
    "check_invariant",
    "check_invariant_model",
    "invariant",
    "invariant_ops",
    "invariant_modes",
    "batch_invariant",
    "Blocks",
    "DecodeState",
    "Routing",
    "prepare_params",
    "streamed",
    "embedded_config",
]
