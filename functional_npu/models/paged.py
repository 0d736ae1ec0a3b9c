"""A paged KV cache: fixed-size blocks in one pool per layer, and a block table per sequence passed into the graph.

A layer's cache is a :class:`PagedKV`: the pools ``k`` and ``v`` ``[blocks, block_size, kv heads, hd]`` and the
step's block ``table [B, blocks per sequence]`` (int64; the same tensor in every layer). Row ``b``'s logical position
``p`` lives in block ``table[b, p // block_size]`` at offset ``p % block_size``. Block 0 is the null block: never
handed to a sequence, it takes the writes of padding (a batch's empty rows, whose table rows are all 0, and a prompt's
pads past its last allocated block), so a step never writes where a live sequence reads.

Each step, :func:`indices` turns the table into flat pool rows: ``read [B, C]`` (every logical position of each row,
``C = blocks per sequence x block_size``) and ``write [B, S]`` (this step's positions). Attention writes the step's
keys and values at ``write`` (an ``index_copy_`` into the pool, in place, as the contiguous cache's ``scatter_``) and
attends over the pool gathered at ``read``, masked by position as the contiguous cache is: the same
queries, keys and mask, so a sequence's tokens do not depend on where its blocks are or who shares its step. The
gather is the decomposition every backend compiles (static shapes: the table's width is fixed per compiled model).

The pool's bookkeeping (which block is whose) is :mod:`functional_npu.runtime.serving.kv_blocks`; the memory a pool
takes is :func:`pool_bytes`, the one rule the engine's budget and the planner both read.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["PagedKV", "indices", "init_paged_kv", "pool_bytes", "NULL_BLOCK"]

NULL_BLOCK = 0  # takes padding's writes; never a sequence's


class PagedKV(NamedTuple):
    """One layer's paged cache: pools ``k``, ``v`` ``[blocks, block_size, kv heads, hd]``, the block ``table``."""

    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor


def indices(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat pool rows ``(read [B, C], write [B, S])`` of ``table [B, nb]`` for ``positions [B, S]``: every logical
    position's row, and this step's positions' (a position past the table's width goes to the null block)."""
    b, nb = table.shape
    offsets = torch.arange(block_size, device=table.device)
    read = (table[:, :, None] * block_size + offsets).reshape(b, nb * block_size)
    within = positions < nb * block_size
    write = read.gather(1, torch.where(within, positions, 0))
    return read, torch.where(within, write, NULL_BLOCK * block_size + positions % block_size)


def init_paged_kv(
    kv_heads: int,
    head_dim: int,
    num_layers: int,
    blocks: int,
    block_size: int,
    table: torch.Tensor,
    dtype: torch.dtype,
    device: Any = None,
) -> list[PagedKV]:
    """Zeroed pools of ``blocks`` blocks (block 0 the null block) for ``num_layers`` layers of ``kv_heads`` local KV
    heads, each layer reading ``table``."""
    shape = (blocks, block_size, kv_heads, head_dim)
    return [
        PagedKV(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device), table)
        for _ in range(num_layers)
    ]


def pool_bytes(kv_heads: int, head_dim: int, num_layers: int, blocks: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of a pool of ``blocks`` blocks: keys and values of every layer."""
    return 2 * num_layers * blocks * block_size * kv_heads * head_dim * dtype.itemsize
