"""A sliding window's KV cache as a ring: a layer that sees the last ``window`` positions keeps
``C = min(window, max_seq_len)`` of them, position ``p`` in slot ``p mod C``.

After a step whose last position (per sequence) is ``t``, slot ``j`` holds position ``t - ((t - j) mod C)``; a
query at ``q`` sees it where that is ``>= 0``, ``<= q`` and ``> q - window`` (the full-length cache's rule,
:func:`~functional_npu.models.attention.attention_mask`, over the positions the slots hold).

- A decode step (``S == 1``) writes its key at slot ``t mod C``, then attends over the ring.
- A multi-token step (a prefill) attends over ``[the ring as it was | its own keys]``, the ring's slots holding the
  positions before the step's first, and leaves in each slot the key of the latest position that maps to it.

A paged ring (a :class:`~functional_npu.models.paged.PagedKV` whose table is a ring table,
:func:`~functional_npu.models.paged.ring_indices`) keeps ``R = blocks x block_size`` slots, at least the window and a
chunk's positions: a step writes its keys first, then attends over the ring, masked by the positions its slots then
hold (a chunk's first query still finds its window: the chunk's writes reach back at most ``R - window`` slots).

A step's positions are consecutive per sequence from its first. A right-padded prefill gives its pads the position
after the prompt's last (serving's prefill does): they land in the one slot the next decode step overwrites first.
"""

from __future__ import annotations

import torch

from .attention import KV, Rotary, Step, rope
from .paged import PagedKV, ring_indices

__all__ = ["cache_len", "held", "window_mask", "prepare"]


def cache_len(window: int | None, max_seq_len: int) -> int:
    """The positions a layer with ``window`` (None: every position) keeps of a ``max_seq_len`` sequence."""
    return max_seq_len if window is None else min(window, max_seq_len)


def held(last: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n]``: the position each slot of an ``n``-slot ring holds after a step whose last positions are
    ``last [B]`` (negative: none yet)."""
    t = last[:, None]
    return t - torch.remainder(t - torch.arange(n, device=last.device), n)


def window_mask(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[B, 1, S, C]`` boolean: a query at position ``queries [B, S]`` sees a key at ``keys [B, C]`` where the key is
    a position (``>= 0``), not after the query and (with a ``window``) within its last ``window`` positions."""
    q, k = queries[:, None, :, None], keys[:, None, None, :]
    mask = (k >= 0) & (k <= q)
    return mask & (k > q - window) if window is not None else mask


def prepare(cfg: Rotary, positions: torch.Tensor, kv: KV, dtype: torch.dtype) -> Step:
    """A ring layer's step for ``positions [B, S]`` over its cache ``kv`` (``[B, kv heads, C, hd]`` each)."""
    b, s = positions.shape
    cos, sin = rope(positions, cfg, dtype)
    if isinstance(kv, PagedKV):  # write the step's keys at their slots, then attend over what the ring then holds
        read, write = ring_indices(kv.table, positions, kv.k.shape[1])
        mask = window_mask(positions, held(positions[:, -1], read.shape[1]), cfg.sliding_window)
        return Step(cos, sin, mask, None, read=read, write=write)
    heads, n = kv[0].shape[1], kv[0].shape[2]
    if s == 1:  # decode: write at p mod C, attend over what the ring then holds
        mask = window_mask(positions, held(positions[:, 0], n), cfg.sliding_window)
        slot = torch.remainder(positions, n)[:, None, :, None].expand(b, heads, 1, cfg.head_dim)
        return Step(cos, sin, mask, slot)
    before = held(positions[:, 0] - 1, n)  # [B, C]: the ring's positions before this step
    mask = window_mask(positions, torch.cat([before, positions], dim=1), cfg.sliding_window)
    # [B, C]: each slot's new position, as a step index (the last column is a row's latest position: prompts are
    # right-padded and pads take the position after their prompt's last; no amax, which GE cannot convert)
    source = held(positions[:, -1], n) - positions[:, :1]
    keep = torch.arange(n, device=positions.device).expand(b, n)
    index = torch.where(source >= 0, n + source.clamp(max=s - 1), keep)  # into [ring | this step's keys]
    return Step(cos, sin, mask, index[:, None, :, None].expand(b, heads, n, cfg.head_dim), gather=True)
