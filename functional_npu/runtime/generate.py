"""Greedy generation over a model family's ``forward``: one padded prefill, then decode steps.

Prompts of different lengths are right-padded into one batch; each sequence decodes at its own
position, so a padded batch gives the same tokens as running each prompt alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..parallel import prefetch
from ..core.mesh import Mesh
from ..models import family_of
from ..parallel.prefetch import check_prefetch_step

__all__ = ["greedy_generate"]


def greedy_generate(
    params: dict,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    mesh: Mesh,
    *,
    forward: Callable[..., torch.Tensor] | None = None,
    max_seq_len: int | None = None,
    prefetch_step: int = 0,
) -> list[list[int]]:
    """Greedy continuation of each prompt: ``max_new_tokens`` token ids per prompt.

    Args:
        params: local params with ``params["config"]`` (from ``load_checkpoint`` or ``shard``).
        prompts: token id lists, any lengths >= 1.
        forward: the family's forward or a compiled version of it (default: the family's forward).
        max_seq_len: KV-cache length (default: longest prompt + max_new_tokens).
        prefetch_step: for layer-sharded params, fetch layer ``l + k``'s weights during layer ``l``
            (eager broadcasts overlap until first use); 0 is synchronous.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_generate: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"greedy_generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    cfg = params["config"]
    lens = torch.tensor([len(p) for p in prompts])
    batch, width = len(prompts), int(lens.max())
    total = max_seq_len or width + max_new_tokens
    if width + max_new_tokens > total:
        raise ValueError(f"greedy_generate: prompts of {width} tokens + {max_new_tokens} new need max_seq_len >= {width + max_new_tokens}, got {total}")
    tokens = torch.zeros(batch, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    dtype = params["embed"].dtype
    family = family_of(cfg)
    forward = forward or family.forward
    cache = family.init_cache(cfg, mesh, batch, total, dtype)
    state = prefetch.start(params, mesh, check_prefetch_step(prefetch_step, cfg.num_layers)) if prefetch_step else None
    logits = forward(params, tokens, torch.arange(width).expand(batch, width), cache, mesh, state)
    step = logits[torch.arange(batch), lens - 1].argmax(-1)  # [B]
    out, pos = [step], lens.clone()
    for _ in range(max_new_tokens - 1):
        step = forward(params, step[:, None], pos[:, None], cache, mesh, state)[:, -1].argmax(-1)
        pos = pos + 1
        out.append(step)
    prefetch.drain(state)
    return torch.stack(out, dim=1).tolist()
