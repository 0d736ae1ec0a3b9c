"""The scoreboard's arithmetic, timed on a fake clock (real timings are reported by
`python -m functional_npu bench`, never asserted)."""

import torch

from functional_npu.cli.bench import FULL, QUICK, best_time, decode_bytes_per_token


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
    from functional_npu.cli.bench_formats import rates

    clock = FakeClock()
    took = {1: iter([0.625, 0.5]), 9: iter([0.75, 1.0])}

    def run(b, n):
        clock.now += next(took[n])

    decode, prefill = rates(run, 1, new=9, prompt_len=10, clock=clock)
    assert (decode, prefill) == (8 / 0.25, 10 / 0.5)
    assert all(next(t, None) is None for t in took.values())


def test_systems_run_interleaved_round_by_round():
    """A B A B: every round runs each system once per batch before the next round starts."""
    from functional_npu.cli.bench_formats import interleaved

    calls = []
    systems = {s: (lambda b, n, s=s: calls.append((s, b))) for s in "AB"}
    out = interleaved(systems, (1, 8), new=3, prompt_len=4, repeat=3, between=lambda r: calls.append(("round", r)))
    per_round = [("A", 1)] * 4 + [("A", 8)] * 4 + [("B", 1)] * 4 + [("B", 8)] * 4
    assert calls == (per_round + [("round", 0)]) + (per_round + [("round", 1)]) + (per_round + [("round", 2)])
    assert all(len(out[s][b]["decode"]) == 3 for s in "AB" for b in (1, 8))


def test_formats_are_one_model_written_four_ways(tmp_path):
    """fp32, bf16, int8 and int4 of the same seeded weights; the bytes a decode token reads shrink with the format
    (every linear layer quantized, lm_head included)."""
    import dataclasses

    from functional_npu import Mesh
    from functional_npu.cli.bench import QUICK
    from functional_npu.cli.bench_formats import FORMATS, decode_bytes, write_formats
    from functional_npu.models.linear import prepare_params
    from functional_npu.runtime.checkpoint import load_checkpoint

    cfg = dataclasses.replace(QUICK, num_layers=1, vocab_size=512)
    paths = write_formats(cfg, tmp_path)
    mesh = Mesh.abstract({"tp": 1}, 0)
    sizes = {}
    for name, path in paths.items():
        params = prepare_params(load_checkpoint(path, mesh))
        assert params["embed"].dtype == FORMATS[name][0]
        assert ("quant" in params) == (FORMATS[name][1] is not None)
        sizes[name] = decode_bytes(params)
    assert sizes["fp32"] > 1.9 * sizes["bf16"] > 1.9 * 1.8 * sizes["int8"] > 1.9 * 1.8 * 1.6 * sizes["int4"]


def test_format_table_has_medians_spread_and_peers():
    from functional_npu.cli.bench_formats import format_table

    res = {
        "formats": {
            "int8": {
                "1": {
                    "tok_s": 300.0,
                    "share_of_roofline": 0.8,
                    "vs_our_fp32": 3.0,
                    "peer": "torchao_int8",
                    "vs_peer": 1.5,
                }
            }
        },
        "systems": {
            "fnpu_int8": {"1": {"median": 300.0, "min": 290.0, "max": 310.0}},
            "torchao_int8": {"1": {"median": 200.0, "min": 190.0, "max": 210.0}},
        },
        "skipped": {"torchao_int4": "torchao int4 weight-only does not run on this CPU"},
    }
    table = format_table(res)
    assert "| int8 | 1 | 300.0 (290.0-310.0) | 80% | 3.00x | torchao_int8 | 200.0 (190.0-210.0) | 1.50x |" in table
    assert "torchao_int4: torchao int4 weight-only does not run on this CPU" in table
