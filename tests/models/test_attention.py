"""Attention's CPU paths: 16-bit decode and short prefills take two grouped matmuls and a float32 softmax
(``grouped``) instead of SDPA's CPU flash kernel; checked against attention written out per head in float64."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu.models.attention import attend, attention_mask, grouped, grouped_scores


def per_head(q, keys, values, mask, scale):
    """Reference: every query head against its KV head (``i // groups``), one at a time, in float64."""
    b, h, s, hd = q.shape
    g = h // keys.shape[1]
    out = torch.empty(b, h, s, values.shape[-1], dtype=torch.float64)
    for i in range(h):
        scores = q[:, i].double() @ keys[:, i // g].double().transpose(-1, -2) * scale  # [B, S, C]
        scores = scores.masked_fill(~mask[:, 0], float("-inf"))
        out[:, i] = torch.softmax(scores, -1) @ values[:, i // g].double()
    return out


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 5),
    kv_heads=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 4]),
    s=st.integers(1, 6),
    extra=st.integers(0, 20),
    hd=st.sampled_from([8, 16, 64]),
    dv=st.sampled_from([None, 24]),
    window=st.sampled_from([None, 3]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_grouped_attention_is_each_head_against_its_kv_head(b, kv_heads, groups, s, extra, hd, dv, window, dtype, seed):
    c = s + extra
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, kv_heads * groups, s, hd, generator=gen).to(dtype)
    keys = torch.randn(b, kv_heads, c, hd, generator=gen).to(dtype)
    values = torch.randn(b, kv_heads, c, dv or hd, generator=gen).to(dtype)
    start = torch.randint(0, extra + 1, (b, 1), generator=gen)
    mask = attention_mask(start + torch.arange(s), c, window)  # every query sees at least its own position
    assert grouped_scores(q, keys)
    want = per_head(q, keys, values, mask, hd**-0.5)
    got = attend(q, keys, values, mask, "sdpa", groups=groups)
    assert got.dtype == dtype and got.shape == want.shape
    # the scores are rounded once to 16 bits before the softmax, the weights once before the second matmul
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=0.05)


def test_grouped_reads_kv_head_i_over_groups_not_i_modulo_heads():
    """The counterexample the tolerance above must catch: query head i read against KV head i % kv_heads."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 16, generator=gen).to(torch.bfloat16)
    keys = torch.randn(2, 2, 9, 16, generator=gen).to(torch.bfloat16) * 3
    values = torch.randn(2, 2, 9, 16, generator=gen).to(torch.bfloat16)
    mask = attention_mask(torch.tensor([[8], [5]]), 9, None)
    want = per_head(q, keys, values, mask, 0.25)
    torch.testing.assert_close(grouped(q, keys, values, mask).double(), want, atol=0.05, rtol=0.05)
    swapped = per_head(q[:, [0, 2, 1, 3]], keys, values, mask, 0.25)[:, [0, 2, 1, 3]]  # head i -> KV head i % 2
    assert not torch.allclose(swapped, want, atol=0.05, rtol=0.05)


@pytest.mark.parametrize(
    "dtype, s, c, device, want",
    [
        (torch.bfloat16, 1, 64, "cpu", True),  # decode
        (torch.float16, 32, 64, "cpu", True),  # a short prefill
        (torch.float32, 1, 64, "cpu", False),  # fp32: SDPA runs as fast, and keeps its float32 scores
        (torch.bfloat16, 1, 64, "meta", False),  # another device: SDPA
        (torch.bfloat16, 4096, 4096, "cpu", False),  # 32 x 8 x 4096 x 4096 float32 scores: past the bound, SDPA
    ],
)
def test_grouped_is_taken_for_small_16_bit_scores_on_the_cpu(dtype, s, c, device, want):
    q = torch.empty(32, 8, s, 64, dtype=dtype, device=device)
    keys = torch.empty(32, 4, c, 64, dtype=dtype, device=device)
    assert grouped_scores(q, keys) is want


def test_compiled_grouped_decode_matches_eager():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 8, 1, 64, generator=gen).to(torch.bfloat16)
    keys = torch.randn(3, 4, 64, 64, generator=gen).to(torch.bfloat16)
    values = torch.randn(3, 4, 64, 64, generator=gen).to(torch.bfloat16)
    mask = attention_mask(torch.tensor([[63], [10], [0]]), 64, None)
    eager = attend(q, keys, values, mask, "sdpa", groups=2)
    compiled = torch.compile(attend, fullgraph=True)(q, keys, values, mask, "sdpa", None, 2)
    torch.testing.assert_close(compiled.double(), per_head(q, keys, values, mask, 64**-0.5), atol=0.05, rtol=0.05)
    torch.testing.assert_close(compiled, eager, atol=0.02, rtol=0.02)
