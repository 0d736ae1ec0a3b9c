"""The invariant functions (functional_npu.models.invariant) against float64 references and their own properties:
each result depends on the values and their positions only (not on the rows beside them, a cache's length, or the
padding), and a tensor-parallel split of a linear's input dim adds up to the unsharded bits."""

import math

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu.models import invariant as inv

ULP = 2.0**-23  # float32's spacing at 1


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs() / (want.abs() * ULP)).max().item()


def test_exp_log_rsqrt_sin_cos_are_within_two_ulp_of_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(200_000, generator=g) * 170 - 86.9  # every float32 exp that is normal
    assert _ulps(inv.exp(x), x.double().exp()) < 1.0
    assert inv.exp(torch.tensor([float("-inf"), -100.0])).tolist() == [0.0, 0.0]
    y = torch.rand(200_000, generator=g) * 1e6 + 1.0
    assert (inv.log(y).double() - y.double().log()).abs().max().item() < 2 * ULP * 14  # |log y| < 14
    assert _ulps(inv.rsqrt(y), y.double().rsqrt()) < 2.0
    a = torch.arange(4096)[:, None].float() * (1.0 / (1e6 ** (torch.arange(0, 128, 2).float() / 128)))
    s, c = inv.sin_cos(a)
    assert (s.double() - a.double().sin()).abs().max().item() <= 0.5 * ULP
    assert (c.double() - a.double().cos()).abs().max().item() <= 0.5 * ULP


@given(n=st.integers(1, 300), extra=st.integers(0, 700), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_a_tree_sum_ignores_trailing_zeros_and_stays_near_the_exact_sum(n, extra, seed):
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(seed))
    padded = torch.cat([x, torch.zeros(3, extra)], dim=1)
    assert torch.equal(inv.tree_sum(x), inv.tree_sum(padded))
    exact = torch.tensor([math.fsum(row) for row in x.double().tolist()])
    assert (inv.tree_sum(x).double() - exact).abs().max().item() <= 2 * math.log2(2 * n) * ULP * x.abs().sum(1).max()


@given(rows=st.integers(1, 9), k=st.sampled_from([8, 24, 64, 96]), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_a_linear_row_does_not_depend_on_its_neighbours_and_tp_splits_add_up_to_its_bits(rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(40, k, generator=g)
    y = inv.linear(x, w)
    assert all(torch.equal(inv.linear(x[i : i + 1], w)[0], y[i]) for i in range(rows))
    assert (y - x @ w.T).abs().max().item() < 1e-4 * k
    chunks = inv.split_of(k)
    for n in (2, 4):
        if chunks % n:
            continue
        part = k // n  # rank r holds input columns [r part, (r + 1) part): its chunks, then the ranks' sums by pairs
        sums = torch.stack([inv.linear(x[:, r * part : (r + 1) * part], w[:, r * part : (r + 1) * part],
                                       chunks // n, torch.float32) for r in range(n)])  # fmt: skip
        assert torch.equal(inv.pair_sum(sums, dim=0), y)


def _causal(s: int, c: int, start: int) -> torch.Tensor:
    return (torch.arange(c)[None, :] <= torch.arange(start, start + s)[:, None]).expand(2, 1, s, c)


@given(cache=st.integers(8, 40), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_attention_gives_a_query_the_same_bits_over_any_cache_length_and_batch(cache, seed):
    """Queries at positions 0..5 over keys 0..5, then the same keys in a longer cache whose other slots hold
    garbage the mask hides, and the last query alone as a decode step."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, 6, 16, generator=g) for h in (4, 2, 2))
    short = inv.attend(q, k, v, _causal(6, 6, 0), groups=2)
    pad = torch.randn(2, 2, cache - 6, 16, generator=g) * 1e3
    long = inv.attend(q, torch.cat([k, pad], 2), torch.cat([v, pad], 2), _causal(6, cache, 0), groups=2)
    assert torch.equal(short, long)
    step = inv.attend(q[:, :, 5:], torch.cat([k, pad], 2), torch.cat([v, pad], 2), _causal(1, cache, 5), groups=2)
    assert torch.equal(step, short[:, :, 5:])
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert (short - ref).abs().max().item() < 1e-5


def test_norm_log_softmax_and_silu_are_close_to_torch_and_row_independent():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 7, 96, generator=g), torch.randn(96, generator=g)
    ref = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (inv.rms_norm(x, w, 1e-6) - ref).abs().max().item() < 1e-5
    assert torch.equal(inv.rms_norm(x[2:3], w, 1e-6), inv.rms_norm(x, w, 1e-6)[2:3])
    z = torch.randn(6, 1000, generator=g) * 5
    assert (inv.log_softmax(z) - torch.log_softmax(z, -1)).abs().max().item() < 1e-5
    assert torch.equal(inv.log_softmax(z[4:5]), inv.log_softmax(z)[4:5])
    assert (inv.silu(z) - F.silu(z)).abs().max().item() < 1e-5
