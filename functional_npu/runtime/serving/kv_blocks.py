"""Which block of a paged KV pool is whose: pure bookkeeping over an immutable value.

A :class:`BlockPool` is the pool's ``size`` blocks of ``block_size`` positions: block 0 is the null block
(:data:`~functional_npu.models.paged.NULL_BLOCK`, padding's writes), the rest are free or owned by one sequence, its
blocks in the order of its positions. :func:`grow` gives a sequence the blocks its positions need (or says there are
not enough: the engine then preempts, nothing is truncated), :func:`release` gives them all back; :func:`check` is the
invariant every step keeps: free and owned blocks add up to the pool, and no block has two owners.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from ...models.paged import NULL_BLOCK

__all__ = ["BlockPool", "new_pool", "blocks_for", "grow", "release", "check", "table_row"]


@dataclass(frozen=True)
class BlockPool:
    """``size`` blocks of ``block_size`` positions; ``free`` block ids (taken from the front) and each sequence's
    ``owned`` blocks, in position order."""

    size: int
    block_size: int
    free: tuple[int, ...]
    owned: Mapping[Hashable, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def used(self) -> int:
        return sum(len(b) for b in self.owned.values())


def new_pool(size: int, block_size: int) -> BlockPool:
    """An empty pool of ``size`` blocks (block 0 the null block, so ``size - 1`` for sequences).

    Raises:
        ValueError: fewer than 2 blocks, or a block size below 1.
    """
    if not (isinstance(size, int) and size >= 2) or not (isinstance(block_size, int) and block_size >= 1):
        raise ValueError(
            f"kv pool: {size!r} blocks of {block_size!r} positions; a pool needs at least 2 blocks (block 0 takes "
            f"padding) of at least 1 position"
        )
    return BlockPool(size, block_size, tuple(b for b in range(size) if b != NULL_BLOCK))


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold ``positions`` positions."""
    return math.ceil(positions / block_size)


def grow(pool: BlockPool, seq: Hashable, positions: int) -> BlockPool | None:
    """``pool`` with ``seq`` holding blocks for its first ``positions`` positions (new blocks from the free list, its
    old ones kept in place); None when the free blocks are too few (the pool unchanged)."""
    have = pool.owned.get(seq, ())
    need = blocks_for(positions, pool.block_size) - len(have)
    if need <= 0:
        return pool
    if need > len(pool.free):
        return None
    owned = dict(pool.owned) | {seq: have + pool.free[:need]}
    return replace(pool, free=pool.free[need:], owned=MappingProxyType(owned))


def release(pool: BlockPool, seq: Hashable) -> BlockPool:
    """``pool`` with every block of ``seq`` free again (at the front of the list: a sequence that comes back finds
    warm blocks); ``pool`` itself when it holds none."""
    if seq not in pool.owned:
        return pool
    owned = {s: b for s, b in pool.owned.items() if s != seq}
    return replace(pool, free=pool.owned[seq] + pool.free, owned=MappingProxyType(owned))


def table_row(pool: BlockPool, seq: Hashable, width: int) -> list[int]:
    """``seq``'s block table row: its blocks, then the null block up to ``width``."""
    blocks = list(pool.owned.get(seq, ()))
    if len(blocks) > width:
        raise ValueError(f"kv pool: sequence {seq!r} holds {len(blocks)} blocks, more than a table row's {width}")
    return blocks + [NULL_BLOCK] * (width - len(blocks))


def check(pool: BlockPool) -> None:
    """Raise an AssertionError unless free and owned blocks are the pool's blocks but the null one, each once."""
    held = [b for blocks in pool.owned.values() for b in blocks] + list(pool.free)
    want = [b for b in range(pool.size) if b != NULL_BLOCK]
    if sorted(held) != want:
        twice = sorted({b for b in held if held.count(b) > 1})
        lost = sorted(set(want) - set(held))
        raise AssertionError(f"kv pool: blocks held twice {twice}, lost {lost} (pool of {pool.size})")
