"""The batch-invariant mode's pins (:mod:`functional_npu.models.batch_invariant`), each beside the plain call it rules
out: the plain call gives a row other bits at another batch size, position, cache length or tensor-parallel split
(the counterexample, measured on this machine's MKL and oneDNN), the pinned one gives the same bits.

log-softmax has no counterexample here: torch's row kernel reduced each row alone at every row count tried (up to a
vocabulary of 151936); it is pinned to rule out the one case a row reduction splits, a single long row."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu.models import batch_invariant as bi
from functional_npu.models import invariant as portable
from functional_npu.models.attention import attend

G = torch.Generator()


@pytest.fixture(autouse=True)
def _seeded():
    """Each test's data the same whatever ran before it (a counterexample holds for given values)."""
    G.manual_seed(0)


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=G).to(dtype)


def test_the_kernel_properties_the_mode_rests_on_hold_here():
    """probe(): rows in fours and key blocks of 64 keep a row's bits; a 1-row call and 1, 3 or 7 keys do not (in
    float32; oneDNN's bfloat16 kernel kept them at these shapes)."""
    got = bi.probe()
    assert all(v["rows_pinned"] and v["keys_pinned"] for v in got.values()), got
    assert got["float32"]["one_row_differs"] and got["float32"]["odd_keys_differ"], got


@pytest.mark.parametrize(
    ("dtype", "k", "n"), [(torch.float32, 256, 1536), (torch.bfloat16, 8192, 2048)], ids=["float32", "bfloat16"]
)
def test_a_linear_row_keeps_its_bits_at_any_batch_and_position(dtype, k, n):
    """A decode step's 1, 3 or 5 rows against a training forward's 64: the plain matmul of a few rows takes another
    kernel (MKL below 4 rows a call or a thread; oneDNN's 1-row bfloat16 kernel at a long input dim)."""
    x, w = _randn(64, k, dtype=dtype), _randn(n, k, dtype=dtype)
    whole_plain, whole = F.linear(x, w), bi.linear(x, w)
    plain_same = [torch.equal(F.linear(x[:r], w), whole_plain[:r]) for r in (1, 3, 5)]
    assert not all(plain_same), "the plain matmul's rows must differ at some batch (the counterexample)"
    for r in (1, 3, 5, 8, 13):
        assert torch.equal(bi.linear(x[:r], w), whole[:r])
        assert torch.equal(bi.linear(x[:r].flip(0), w).flip(0), whole[:r])  # another position


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), start=st.integers(0, 23), k=st.sampled_from([64, 96, 256]))
def test_any_slice_of_rows_gets_the_whole_batchs_bits(rows, start, k):
    x, w = _randn(64, k), _randn(192, k)
    assert torch.equal(bi.linear(x[start : start + rows], w), bi.linear(x, w)[start : start + rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_parallel_linear_gives_the_unsharded_bits_at_tp_2_4_8(dtype):
    """Each rank sums its chunks, the ranks' float32 sums are added by adjacent pairs: the unsharded chunked linear's
    bits. The plain split (each half a matmul, the halves added as an all-reduce adds them) does not keep them."""
    x, w = _randn(24, 512, dtype=dtype), _randn(384, 512, dtype=dtype)
    whole = bi.linear(x, w, 8, torch.float32)
    for tp in (2, 4, 8):
        part = 512 // tp
        ranks = [bi.linear(x[:, i * part : (i + 1) * part], w[:, i * part : (i + 1) * part], 8 // tp, torch.float32)
                 for i in range(tp)]  # fmt: skip
        assert torch.equal(portable.pair_sum(torch.stack(ranks), dim=0), whole)
    halves = F.linear(x[:, :256].float(), w[:, :256].float()) + F.linear(x[:, 256:].float(), w[:, 256:].float())
    assert not torch.equal(halves, F.linear(x.float(), w.float())), "the plain split must differ (the counterexample)"


def test_a_query_alone_over_any_cache_gets_the_training_forwards_bits():
    """A decode query over caches of 21, 64 and 300 slots (the keys past it masked) against the same query among all
    300 of a training forward: SDPA and the matmul-softmax path give other bits every time; the key blocks give the
    same."""
    s = 300
    q, keys, values = _randn(1, 4, s, 64), _randn(1, 4, s, 64), _randn(1, 4, s, 64)
    causal = (torch.arange(s)[:, None] >= torch.arange(s)[None])[None, None]

    def agree(fn) -> list[bool]:
        full = fn(q, keys, values, causal)
        out = []
        for pos in (20, 250):
            for c in (pos + 1, 64 * (pos // 64 + 1), s):
                mask = (torch.arange(c) <= pos)[None, None, None]
                out.append(torch.equal(fn(q[:, :, pos : pos + 1], keys[:, :, :c], values[:, :, :c], mask),
                                       full[:, :, pos : pos + 1]))  # fmt: skip
        return out

    assert not any(agree(lambda *a: attend(*a, "sdpa")))
    assert not any(agree(lambda *a: attend(*a, "math")))
    assert all(agree(bi.attend))


def test_grouped_queries_keep_their_bits_in_a_batch():
    """Two KV heads of four query heads each, one sequence alone against the same sequence beside two others."""
    q, keys, values = _randn(3, 8, 5, 32), _randn(3, 2, 40, 32), _randn(3, 2, 40, 32)
    mask = (torch.arange(40)[None] <= torch.arange(5)[:, None] + 10)[None, None].expand(3, 1, 5, 40)
    together = bi.attend(q, keys, values, mask, groups=4)
    assert torch.equal(bi.attend(q[1:2], keys[1:2], values[1:2], mask[1:2], groups=4), together[1:2])


def test_a_long_row_is_never_split_across_threads():
    """One bfloat16 row of 40000 is reduced in two passes over the threads when it is alone (the plain mean of
    squares gives other bits than in a batch of 8); the norm's rows come in fours."""
    x, weight = _randn(8, 40000, dtype=torch.bfloat16), _randn(40000, dtype=torch.bfloat16)
    plain = x.float().pow(2).mean(-1)
    alone = [torch.equal(x[i : i + 1].float().pow(2).mean(-1), plain[i : i + 1]) for i in range(8)]
    assert not all(alone), "the counterexample"
    pinned = bi.rms_norm(x, weight, 1e-6)
    assert all(torch.equal(bi.rms_norm(x[i : i + 1], weight, 1e-6), pinned[i : i + 1]) for i in range(8))


def test_silu_keeps_an_elements_bits_wherever_it_sits():
    """Torch's float32 SiLU computes a tensor's last few elements (past its last full vector) another way than the
    rest: 15 values alone get other bits than inside a tensor of 4096 (in about half of the slices here); the
    polynomial gives the same."""
    x = _randn(4096)
    plain, pinned = F.silu(x), bi.silu(x)
    starts = range(0, 4096 - 15, 15)
    assert not all(torch.equal(F.silu(x[i : i + 15]), plain[i : i + 15]) for i in starts), "the counterexample"
    assert all(torch.equal(bi.silu(x[i : i + 15]), pinned[i : i + 15]) for i in starts)


def test_log_softmax_rows_keep_their_bits():
    x = _randn(8, 4096)
    assert torch.equal(bi.log_softmax(x[:1]), bi.log_softmax(x)[:1])
    assert torch.equal(bi.log_softmax(x[None])[0, 3:5], bi.log_softmax(x)[3:5])
