"""The paged KV pool's bookkeeping: after any sequence of grows and releases, free and owned blocks add up to the pool
and no block has two owners; a grow that does not fit changes nothing; and the flat indices a block table gives
address each position of each row once, in its own blocks (counted here from the table, not by the code under
test)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu.models.paged import NULL_BLOCK, indices
from functional_npu.runtime.serving import kv_blocks


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(2, 40),
    block_size=st.integers(1, 8),
    ops=st.lists(st.tuples(st.sampled_from(["grow", "release"]), st.integers(0, 5), st.integers(0, 60)), max_size=60),
)
def test_blocks_add_up_and_have_one_owner_after_any_grows_and_releases(size, block_size, ops):
    pool = kv_blocks.new_pool(size, block_size)
    for op, seq, positions in ops:
        before = pool
        if op == "release":
            pool = kv_blocks.release(pool, seq)
            assert seq not in pool.owned
        else:
            grown = kv_blocks.grow(pool, seq, positions)
            need = kv_blocks.blocks_for(positions, block_size) - len(pool.owned.get(seq, ()))
            if grown is None:
                assert need > len(pool.free)  # refused only when it does not fit; the pool unchanged
                continue
            pool = grown
            held = pool.owned.get(seq, ())
            assert len(held) >= kv_blocks.blocks_for(positions, block_size)
            assert held[: len(before.owned.get(seq, ()))] == before.owned.get(seq, ())  # old blocks stay in place
        kv_blocks.check(pool)
        assert len(pool.free) + pool.used == size - 1
        assert NULL_BLOCK not in pool.free and all(NULL_BLOCK not in b for b in pool.owned.values())


def test_the_check_finds_a_block_with_two_owners():
    pool = kv_blocks.grow(kv_blocks.new_pool(4, 2), "a", 3)
    bad = kv_blocks.BlockPool(4, 2, pool.free, {"a": pool.owned["a"], "b": pool.owned["a"][:1]})
    with pytest.raises(AssertionError, match=r"blocks held twice \[1\]"):
        kv_blocks.check(bad)


def test_a_pool_too_small_is_refused():
    with pytest.raises(ValueError, match=r"a pool needs at least 2 blocks"):
        kv_blocks.new_pool(1, 16)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), rows=st.integers(1, 4), nb=st.integers(1, 5), block_size=st.integers(1, 4))
def test_a_tables_indices_address_each_position_in_its_own_block(data, rows, nb, block_size):
    blocks = list(range(1, rows * nb + 1))
    perm = data.draw(st.permutations(blocks))
    table = torch.tensor(perm).reshape(rows, nb)
    s = data.draw(st.integers(1, 6))
    positions = torch.tensor([data.draw(st.lists(st.integers(0, nb * block_size + 3), min_size=s, max_size=s))
                              for _ in range(rows)])  # fmt: skip
    read, write = indices(table, positions, block_size)
    for r in range(rows):
        for p in range(nb * block_size):  # position p of row r: block table[r, p // bs], offset p % bs
            assert int(read[r, p]) == int(table[r, p // block_size]) * block_size + p % block_size
        for j in range(s):
            p = int(positions[r, j])
            want = read[r, p] if p < nb * block_size else NULL_BLOCK * block_size + p % block_size
            assert int(write[r, j]) == int(want)
    assert len(set(read.flatten().tolist())) == read.numel()  # no two positions share a row of the pool
