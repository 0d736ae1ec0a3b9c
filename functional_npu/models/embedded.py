"""The embedded models: small Qwen3-style configs shipped with the library, as their ``config.json`` would say them, so
that the demo, the benchmarks' quick runs and a first try need no download (their weights are seeded and random:
``family_of(config).init_params``).

- ``"demo"``: the demo's model, 6.8M params (27 MB in fp32): 6 layers, so that over 2 ranks with a 2-slot ring a rank
  holds 3 + 2 = 5 layers of a layer-sharded series and saves;
- ``"small"``: the same with a 512-token vocabulary and half the width, for a compiled train step in seconds.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["EMBEDDED", "embedded_config"]

_DEMO = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "max_position_embeddings": 512,
}
EMBEDDED = ("demo", "small")
_CONFIGS = {
    "demo": _DEMO,
    "small": _DEMO | {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 384, "head_dim": 32},
}


def embedded_config(name: str) -> dict[str, Any]:
    """A fresh copy of embedded model ``name``'s ``config.json`` (one of :data:`EMBEDDED`).

    Raises:
        ValueError: an unknown name, listing the embedded models.
    """
    if name not in _CONFIGS:
        raise ValueError(f"no embedded model {name!r}; the embedded models are {list(EMBEDDED)}")
    return copy.deepcopy(_CONFIGS[name])
