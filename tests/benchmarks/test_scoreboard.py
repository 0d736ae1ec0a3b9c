"""The scoreboard's arithmetic (real timings are reported by `python -m benchmarks bench`, never asserted)."""

import pytest
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


def test_a_released_models_runs_sit_beside_the_default_ones(tmp_path):
    """``--model`` runs go under ``sizes``; a default run replaces only the default runs, ``--append`` adds one."""
    from benchmarks.scoreboard import merged

    def run(tag):
        return {"decode": {"cells": {}}, "tag": tag}

    whole = merged({}, run("a"), None, append=False)
    whole = merged(whole, run("r1"), "qwen3-0.6b", append=False)
    whole = merged(whole, run("r2"), "qwen3-0.6b", append=True)
    whole = merged(whole, run("b"), None, append=False)
    assert [r["tag"] for r in whole["runs"]] == ["b"]
    assert [r["tag"] for r in whole["sizes"]["qwen3-0.6b"]["runs"]] == ["r1", "r2"]
    assert whole["sizes"]["qwen3-0.6b"]["targets"] == [] and "targets" in whole


def test_compiles_are_cold_in_a_directory_of_their_own_and_the_setting_is_restored(tmp_path, monkeypatch):
    import os

    from benchmarks.scoreboard import cold_compiles

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    with cold_compiles(tmp_path / "c"):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["--formats", "fp32,int3"],
            "--formats takes a comma-separated list of fp32, bf16, int8, int4, got 'fp32,int3'",
        ),
        (["--formats", ","], "--formats takes a comma-separated list"),
        (["--model", "qwen3-0.6b", "--quick"], "--quick shrinks the benchmarks' own model"),
        (["--model", "llama-70b"], "argument --model: invalid choice: 'llama-70b'"),
    ],
)
def test_bad_flags_are_refused_before_any_work(argv, says, capsys):
    from benchmarks.scoreboard import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
