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
