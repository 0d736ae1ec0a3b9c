"""The scoreboard's arithmetic (real timings are reported by `python -m benchmarks bench`, never asserted)."""

import torch

from benchmarks.configs import FULL, QUICK
from benchmarks.scoreboard import decode_bytes_per_token


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
