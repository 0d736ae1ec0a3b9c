"""The scoreboard's arithmetic (timings themselves are reported by `python -m functional_npu bench`, never asserted)."""

import torch

from functional_npu.cli.bench import FULL, QUICK, _rates, decode_bytes_per_token, matvec_bandwidth


def test_decode_bytes_per_token_counts_every_weight_but_the_embedding_table():
    cfg = QUICK
    d, f, v, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    layer = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd * d + d * cfg.num_heads * hd + 3 * d * f + 2 * d + 2 * hd
    assert decode_bytes_per_token(cfg) == 4 * (cfg.num_layers * layer + v * d + d + d)  # layers, lm_head, final norm, one embedding row
    assert decode_bytes_per_token(cfg, torch.bfloat16) == decode_bytes_per_token(cfg) // 2


def test_bench_model_is_in_the_issue_size_range():
    from functional_npu.models.llama import abstract_params
    from functional_npu.core.tree import flatten_with_paths

    n = sum(x.numel() for _, x in flatten_with_paths(abstract_params(FULL)))
    assert 50e6 <= n <= 100e6


def test_rates_separate_decode_from_prefill():
    fake = {1: 0.5, 9: 0.9}  # 1 token: prefill only; 8 more decode steps take 0.4 s

    def run(n):
        import time

        time.sleep(fake[n])

    decode, prefill = _rates(run, prompt_len=10, new=9, repeat=1)
    assert abs(decode - 8 / 0.4) < 3 and abs(prefill - 10 / 0.5) < 2


def test_matvec_bandwidth_is_positive():
    assert matvec_bandwidth(mib=8, repeat=2) > 1e8
