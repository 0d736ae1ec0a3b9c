"""The GPU script's pieces that need no GPU: its refusal without CUDA, the roofline's floor and the cells' sums."""

import pytest
import torch

from benchmarks.gpu import gpu_cells, main
from benchmarks.roofline import step_cost, step_floor


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_says_so_in_one_line_and_exits_2(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU here" in err


def test_the_floor_is_the_larger_of_reading_and_computing():
    assert step_floor(4e9, 1e12, 2e12, 1e15) == (2e-3, "memory")  # 2 ms to read, 1 ms to compute
    assert step_floor(1e9, 4e12, 2e12, 1e15) == (4e-3, "compute")


def test_cells_take_shares_and_ratios_round_by_round():
    decode = {"fnpu_bf16": {"8": [100.0, 300.0]}, "hf_bf16": {"8": [50.0, 300.0]}}
    cells = gpu_cells("bf16", decode, {"8": (8e9, 1e12)}, [4e12, 2e12], 1e15)["8"]
    # round 1: floor max(2 ms, 1 ms) -> 4000 tok/s at batch 8; round 2: max(4 ms, 1 ms) -> 2000 tok/s
    assert cells["roofline_tok_s"]["runs"] == [4000.0, 2000.0]
    assert cells["share_of_roofline"]["min"] == pytest.approx(0.025) and cells["binds"] == "memory"
    assert cells["peers"]["hf_bf16"] == {"median": 1.5, "min": 1.0, "max": 2.0}


def test_a_steps_cost_counts_weights_once_and_flops_per_token():
    from benchmarks.configs import QUICK
    from benchmarks.roofline import weight_count

    n = weight_count(QUICK)
    ctx = 32 + 16 / 2
    kv = QUICK.num_layers * 2 * QUICK.num_kv_heads * QUICK.head_dim * ctx * 4
    attn = 4 * QUICK.num_layers * QUICK.num_heads * QUICK.head_dim * ctx
    assert step_cost(QUICK, 1000, 4, 1, 32, 16) == (1000 + kv, 2 * n + attn)
    # FLOPs follow the parameters, not the bytes: an int4 model does as many as the fp32 one at 1/8 the bytes
    assert step_cost(QUICK, 125, 2, 8, 32, 16)[1] == 8 * (2 * n + attn)


def test_the_real_shapes_are_the_released_models():
    """Counted two ways: this library's params on the meta device, and transformers' own model class built from the
    config.json fields this library writes. Qwen3-8B has 8.19B params; Qwen3-0.6B ties its head (0.60B), the
    benchmark's unties it (0.75B)."""
    import transformers as T

    from benchmarks.configs import QWEN3_0_6B, QWEN3_8B
    from benchmarks.real_shapes import param_count

    for cfg, want in ((QWEN3_8B, 8_190_735_360), (QWEN3_0_6B, 751_632_384)):
        hf = cfg.to_hf()
        with torch.device("meta"):
            model = T.AutoModelForCausalLM.from_config(T.CONFIG_MAPPING[hf["model_type"]](**hf))
        assert type(model).__name__ == "Qwen3ForCausalLM"
        assert param_count(cfg) == sum(p.numel() for p in model.parameters()) == want
    assert param_count(QWEN3_0_6B) - QWEN3_0_6B.vocab_size * QWEN3_0_6B.hidden_size == 596_049_920


def test_a_real_cell_the_device_cannot_hold_is_skipped_in_one_line_with_its_figures():
    from benchmarks.configs import QWEN3_8B
    from benchmarks.gpu import real_format
    from benchmarks.real_shapes import needed_bytes, refusal

    need = needed_bytes(QWEN3_8B, torch.bfloat16, 1, 64)
    assert need == 2 * (8_190_735_360 * 2 + 2 * 36 * 8 * 128 * 64 * 2 + 151936 * 4)
    assert refusal("x", need, need, "cuda") is None
    assert refusal("x", need, need - 1, "cuda") == (
        "x: needs 30.5 GiB of cuda memory (two systems' weights, caches and logits), 30.5 GiB free; skipped"
    )
    # a batch whose caches no host holds: refused before anything is built
    got = real_format(QWEN3_8B, "bf16", 1, 3, 1e12, print, device="cpu", batches=(1 << 20,))
    assert list(got) == ["skipped"] and got["skipped"].startswith("36-layer bf16 model: needs ")
    assert "\n" not in got["skipped"]


def test_a_real_cell_runs_through_on_the_cpu_with_a_small_stand_in():
    """Everything the GPU run does but the device: both systems built from one config with random weights, compiled,
    timed in a round and set against the roofline and each other."""
    import dataclasses

    from benchmarks.configs import QWEN3_0_6B
    from benchmarks.gpu import real_format

    small = dataclasses.replace(
        QWEN3_0_6B, num_layers=1, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
        vocab_size=512,
    )  # fmt: skip
    got = real_format(small, "bf16", 1, 3, 1e11, lambda *a, **k: None, device="cpu", batches=(2,), read=lambda: 1e10)
    assert "skipped" not in got, got
    cell = got["cells"]["2"]
    assert cell["tok_s"]["median"] > 0 and len(cell["tok_s"]["runs"]) == 1
    assert set(cell["peers"]) == {"hf_bf16"} and cell["binds"] in ("memory", "compute")
    assert set(got["warm_s"]) == set(got["build_s"]) == {"fnpu_bf16", "hf_bf16"}
    assert got["params"] == sum(p.numel() for p in [torch.empty(512, 64)] * 2) + 64 + (
        64 * (4 + 2 + 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128 + 2 * 64 + 2 * 16
    )
