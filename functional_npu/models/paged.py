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

__all__ = ["PagedKV", "Tails", "indices", "paged", "tails_of", "init_paged_kv", "pool_bytes", "NULL_BLOCK"]

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


def paged(pool: torch.Tensor, x: torch.Tensor, write: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """Write ``x [B, heads, S, d]`` into ``pool [blocks, block_size, heads, d]`` at the flat rows ``write [B, S]`` (in
    place); the pool gathered at ``read [B, C]``, ``[B, heads, C, d]``."""
    flat = pool.view(-1, pool.shape[2], pool.shape[3])
    flat.index_copy_(0, write.reshape(-1), x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]))
    return flat[read].transpose(1, 2)


Tails = list[tuple[tuple[int, int], tuple[int, int]]]  # per layer: the (heads, dim) of its two pools


def tails_of(contiguous: list) -> Tails:
    """Each layer's pools' ``(heads, dim)`` from the family's contiguous cache of one sequence and one position
    (``Blocks.init_kv``, made on the meta device): ``[1, heads, 1, dim]`` each, whatever the attention (grouped
    KV heads, MLA's latent and rope keys, or its heads' keys and values)."""
    return [((k.shape[1], k.shape[3]), (v.shape[1], v.shape[3])) for k, v in contiguous]


def init_paged_kv(tails: Tails, blocks: int, block_size: int, table: torch.Tensor, dtype: torch.dtype,
                  device: Any = None) -> list[PagedKV]:  # fmt: skip
    """Zeroed pools of ``blocks`` blocks (block 0 the null block) per layer, each layer reading ``table``."""
    return [
        PagedKV(
            torch.zeros(blocks, block_size, *k, dtype=dtype, device=device),
            torch.zeros(blocks, block_size, *v, dtype=dtype, device=device),
            table,
        )
        for k, v in tails
    ]


def pool_bytes(tails: Tails, blocks: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of a pool of ``blocks`` blocks: both pools of every layer."""
    per_position = sum(k[0] * k[1] + v[0] * v[1] for k, v in tails)
    return blocks * block_size * per_position * dtype.itemsize
