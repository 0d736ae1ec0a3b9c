"""The scoreboard's arithmetic, timed on a fake clock (real timings are reported by
`python -m functional_npu bench`, never asserted)."""

import torch

from functional_npu.cli.bench import FULL, QUICK, _rates, best_time, decode_bytes_per_token


def test_decode_bytes_per_token_counts_every_weight_but_the_embedding_table():
    cfg = QUICK
    d, f, v, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    layer = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd * d + d * cfg.num_heads * hd + 3 * d * f + 2 * d + 2 * hd
    assert decode_bytes_per_token(cfg) == 4 * (
        cfg.num_layers * layer + v * d + d + d
    )  # layers, lm_head, final norm, one embedding row
    assert decode_bytes_per_token(cfg, torch.bfloat16) == decode_bytes_per_token(cfg) // 2


def test_bench_model_is_in_the_issue_size_range():
    from functional_npu.core.tree import flatten_with_paths
    from functional_npu.models.llama import abstract_params

    n = sum(x.numel() for _, x in flatten_with_paths(abstract_params(FULL)))
    assert 50e6 <= n <= 100e6


class FakeClock:
    """A clock that only moves when a timed call says how long it took."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_best_time_is_the_fastest_run():
    clock, took = FakeClock(), iter([0.75, 0.25, 0.5])

    def fn():
        clock.now += next(took)

    assert best_time(fn, 3, clock=clock) == 0.25
    assert next(took, None) is None  # fn ran exactly repeat times


def test_rates_separate_decode_from_prefill():
    """1 new token is prefill only (best 0.5 s for 10 prompt tokens); 8 more decode steps add 0.25 s."""
    clock = FakeClock()
    took = {1: iter([0.625, 0.5]), 9: iter([0.75, 1.0])}

    def run(n):
        clock.now += next(took[n])

    decode, prefill = _rates(run, prompt_len=10, new=9, repeat=2, clock=clock)
    assert (decode, prefill) == (8 / 0.25, 10 / 0.5)
    assert all(next(t, None) is None for t in took.values())
