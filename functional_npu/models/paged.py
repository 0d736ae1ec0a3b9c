"""A paged KV cache: fixed-size blocks in one pool per layer, and a block table per sequence passed into the graph.

A layer's cache is a :class:`PagedKV`: the pools ``k`` and ``v`` ``[blocks, block_size, kv heads, hd]`` and the
step's block ``table [B, blocks per sequence]`` (int64; the same tensor in every layer). Row ``b``'s logical position
``p`` lives in block ``table[b, p // block_size]`` at offset ``p % block_size``. Block 0 is the null block: never
handed to a sequence, it takes the writes of padding (a batch's empty rows, whose table rows are all 0, and a prompt's
pads past its last allocated block), so a step never writes where a live sequence reads.

Each step, :func:`indices` turns the table into flat pool rows: ``read [B, C]`` (every logical position of each row,
``C = blocks per sequence x block_size``) and ``write [B, S]`` (this step's positions). Attention writes the step's
keys and values at ``write`` (an ``index_put_`` into the pool, in place) and
attends over the pool gathered at ``read``, masked by position as the contiguous cache is: the same
queries, keys and mask, so a sequence's tokens do not depend on where its blocks are or who shares its step. The
gather is the decomposition every backend compiles (static shapes: the table's width is fixed per compiled model).

A layer that keeps only a sliding window (Gemma 3's sliding layers) has pools of its own and a *ring* table of
:func:`ring_width` blocks per sequence, reused as the sequence moves on (:func:`ring_indices`,
:mod:`functional_npu.models.ring`): its blocks cover the window, not the context. :class:`Layout` says which layers
those are (:func:`layout_of`, from the family's own contiguous cache).

The pool's bookkeeping (which block is whose) is :mod:`functional_npu.runtime.serving.kv_blocks`; the memory a pool
takes is :func:`pool_bytes`, the one rule the engine's budget and the planner both read.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

__all__ = [
    "PagedKV",
    "Layout",
    "indices",
    "ring_indices",
    "paged",
    "layout_of",
    "ring_width",
    "init_pools",
    "pool_bytes",
    "cache_bytes",
    "BLOCK_SIZE",
    "NULL_BLOCK",
]

NULL_BLOCK = 0  # takes padding's writes; never a sequence's
BLOCK_SIZE = 16  # positions per block unless the engine is given another


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
    place); the pool gathered at ``read [B, C]``, ``[B, heads, C, d]``.

    The write is an ``index_put_`` on the pool itself, indexed by (block, offset): no view of the pool is written, so
    the graph compilers turn the functional write back into an in-place one (a scatter into a flattened view of the
    pool is left functional by npugraph_ex: a copy of the whole pool per layer and step)."""
    bs = pool.shape[1]
    rows = write.reshape(-1)
    pool.index_put_((rows // bs, rows % bs), x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]))
    return pool[read // bs, read % bs].transpose(1, 2)


def ring_indices(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat pool rows ``(read [B, R], write [B, S])`` of a ring table ``table [B, nb]`` (``R = nb x block_size``
    slots, position ``p`` in slot ``p mod R``: a sliding window's blocks, reused as the sequence moves on)."""
    b, nb = table.shape
    offsets = torch.arange(block_size, device=table.device)
    read = (table[:, :, None] * block_size + offsets).reshape(b, nb * block_size)
    return read, read.gather(1, torch.remainder(positions, nb * block_size))


Tails = list[tuple[tuple[int, int], tuple[int, int]]]  # per layer: the (heads, dim) of its two pools


class Layout(NamedTuple):
    """A model's paged cache on one rank: each layer's pools' ``(heads, dim)`` (``tails``) and, per layer, the
    window a ring layer keeps (``windows``: None for a layer that keeps every position)."""

    tails: Tails
    windows: tuple[int | None, ...]

    @property
    def window(self) -> int | None:
        """The ring layers' window (they share one; None: no ring layer)."""
        return next((w for w in self.windows if w is not None), None)


def layout_of(contiguous: list, max_seq_len: int) -> Layout:
    """The paged layout of a family's contiguous cache of one sequence of ``max_seq_len`` positions
    (``Blocks.init_kv``, made on the meta device): ``[1, heads, n, dim]`` each, whatever the attention (grouped KV
    heads, MLA's latent and rope keys, or its heads' keys and values); a layer with ``n < max_seq_len`` keeps a ring of
    its window (Gemma 3's sliding layers).

    Raises:
        ValueError: ring layers of different windows (one ring table serves them all).
    """
    tails = [((k.shape[1], k.shape[3]), (v.shape[1], v.shape[3])) for k, v in contiguous]
    windows = tuple(k.shape[2] if k.shape[2] < max_seq_len else None for k, _ in contiguous)
    if len({w for w in windows if w is not None}) > 1:
        raise ValueError(f"paged cache: ring layers of windows {sorted({w for w in windows if w})}; one is supported")
    return Layout(tails, windows)


def ring_width(layout: Layout, chunk: int, block_size: int, width: int) -> int:
    """Blocks of a ring table row: the window and a chunk's positions (a chunk's first query still sees its window
    after the chunk's writes), at most a full row's ``width``; 0 without ring layers."""
    if layout.window is None:
        return 0
    return min(width, math.ceil((layout.window + chunk) / block_size))


def init_pools(layout: Layout, blocks: int, ring_blocks: int, block_size: int, dtype: torch.dtype,
               device: Any = None) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Zeroed pools per layer: ``blocks`` blocks for a layer that keeps every position, ``ring_blocks`` for a ring
    layer (block 0 of each the null block)."""
    return [
        tuple(
            torch.zeros(blocks if w is None else ring_blocks, block_size, *t, dtype=dtype, device=device)
            for t in (k, v)
        )
        for (k, v), w in zip(layout.tails, layout.windows)
    ]


def pool_bytes(layout: Layout, blocks: int, block_size: int, dtype: torch.dtype, ring_blocks: int = 0) -> int:
    """Bytes of the pools :func:`init_pools` makes: ``blocks`` blocks of every layer that keeps every position,
    ``ring_blocks`` of every ring layer."""
    size = 0
    for (k, v), w in zip(layout.tails, layout.windows):
        size += (blocks if w is None else ring_blocks) * (k[0] * k[1] + v[0] * v[1])
    return size * block_size * dtype.itemsize


def cache_bytes(layout: Layout, seqs: int, positions: int, dtype: torch.dtype, chunk: int,
                block_size: int = BLOCK_SIZE) -> int:  # fmt: skip
    """Bytes of the pools that hold ``seqs`` sequences of ``positions`` positions at once, prefilled in chunks of
    ``chunk``: each sequence's blocks (a ring layer's :func:`ring_width`), and the null blocks. What a serving
    engine's budget buys (:func:`pool_bytes`, the one rule) and what the planner prices a sequence at."""
    width = math.ceil(positions / block_size)
    rings = ring_width(layout, chunk, block_size, width)
    return pool_bytes(layout, seqs * width + 1, block_size, dtype, seqs * rings + 1 if rings else 0)
