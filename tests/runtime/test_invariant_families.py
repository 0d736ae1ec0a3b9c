"""The invariant modes (``Plan(invariant="batch")`` and ``"portable"``) of the MoE family (Qwen3-MoE: router,
softmax top-k, renormalized, experts per token and chosen expert) and of the DeepSeek family (latent attention,
sigmoid / softmax group-limited routing, shared experts): a rollout's log-probabilities (batches 1, 3 and 8, a prefill
then decode steps, the experts on the small-batch path) equal the training forward's (the whole sequences, the experts
on the large-batch path) bit for bit, in float32 and bfloat16 on one rank, and for the MoE on two tensor-parallel gloo
ranks, each expert tensor-parallel or the experts sharded over tp (gathered for decode, exchanged by all_to_all for the
rest). With the mode off the same comparisons differ: the tests fail without it. One case per mode compiles the MoE with
inductor (one layer, float32; the compiled rollout against the eager training forward). The invariant forward stays
within 1e-4 of transformers' float32 logits, so the mode is not wrong-but-consistent.
"""

import pytest
import torch

from functional_npu import Mesh, Plan, load_checkpoint
from functional_npu.runtime.training.grad import logits

from ..support.hf_models import save_tiny_deepseek, save_tiny_moe
from ..support.invariant_workers import PROMPTS, dp_logits, gaps_on_rank, model_for, rollout_gaps

BATCHES = [PROMPTS[b] for b in (1, 3, 8)]
MODES = ["batch", "portable"]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-moe-invariant")
    return str(path), save_tiny_moe("qwen3_moe", path, 5)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """{family: (dir, transformers model)}: V3 (low-rank query, sigmoid group-limited routing with the correction
    bias, interleaved rope), V3 with yarn rope (plain q_proj, halves layout), V2 (softmax, routed scale)."""
    out = {}
    for i, family in enumerate(("deepseek_v3", "deepseek_v3_yarn", "deepseek_v2")):
        path = tmp_path_factory.mktemp(family)
        out[family] = (str(path), save_tiny_deepseek(family, path, 5 + i))
    return out


def close_to_transformers(path: str, hf, mode: str) -> None:
    """The invariant forward's float32 logits within 1e-4 of transformers'."""
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = load_checkpoint(path, mesh, Plan(invariant=mode))
    tokens = torch.tensor([[7, 3, 9, 4, 11, 60, 2, 99, 14]])
    with torch.no_grad():
        want = hf(tokens).logits
    torch.testing.assert_close(logits(params, tokens, mesh), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_rollout_logprobs_equal_training_forward_eager(qwen3_moe, dtype, mode):
    model, mesh = model_for(None, qwen3_moe[0], 1, dtype, mode, "none")
    assert rollout_gaps(model, mesh, BATCHES) == [0.0, 0.0, 0.0]
    # the control in float32: in bfloat16 the default forward's attention (attention.grouped, two batched
    # matmuls) gives these small inputs the same bits in both forwards, so it shows nothing there
    off, mesh = model_for(None, qwen3_moe[0], 1, "float32", False, "none")
    assert max(rollout_gaps(off, mesh, BATCHES)) > 0.0, "without the mode the two forwards must differ (the control)"


@pytest.mark.parametrize("expert_axes", [(), ("tp",)], ids=["expert-tp", "expert-parallel"])
@pytest.mark.parametrize("mode", MODES)
def test_moe_rollout_logprobs_equal_training_forward_tp2(world2, qwen3_moe, expert_axes, mode):
    on = world2.run(gaps_on_rank, qwen3_moe[0], 2, "float32", mode, expert_axes=expert_axes)
    assert on == [[0.0, 0.0, 0.0]] * 2
    off = world2.run(gaps_on_rank, qwen3_moe[0], 2, "float32", False, expert_axes=expert_axes)
    assert max(max(g) for g in off) > 0.0


@pytest.mark.parametrize("rows", [1, 4], ids=["gathered", "dispatched"])
@pytest.mark.parametrize("mode", MODES)
def test_moe_expert_parallelism_over_dp_keeps_each_tokens_bits(world4, qwen3_moe, rows, mode):
    """Whole experts sharded over dp and tp (each dp rank's tokens exchanged with the others') against whole experts
    over tp only: the same logits bit for bit, with 5 tokens a rank (gathered) and 18 (all_to_all)."""
    base = world4.run(dp_logits, qwen3_moe[0], ("tp",), rows, mode)
    over_dp = world4.run(dp_logits, qwen3_moe[0], ("dp", "tp"), rows, mode)
    assert all(torch.equal(a, b) for a, b in zip(base, over_dp))


@pytest.mark.parametrize("mode", MODES)
def test_moe_compiled_rollout_equals_eager_training_forward(tmp_path, mode):
    """Inductor's rollout (one MoE layer, float32: a minute to compile on 2 cores) against the eager forward."""
    save_tiny_moe("qwen3_moe", tmp_path, 5, num_hidden_layers=1)
    model, mesh = model_for(None, str(tmp_path), 1, "float32", mode, "inductor", sizes=(4,))
    assert rollout_gaps(model, mesh, [PROMPTS[3]]) == [0.0]


@pytest.mark.parametrize("mode", MODES)
def test_moe_invariant_forward_is_close_to_transformers(qwen3_moe, mode):
    close_to_transformers(*qwen3_moe, mode)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_yarn", "deepseek_v2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_deepseek_rollout_logprobs_equal_training_forward_eager(deepseek, family, dtype, mode):
    """The latent cache (decode attends the plain way in the mode, never absorbed)."""
    model, mesh = model_for(None, deepseek[family][0], 1, dtype, mode, "none")
    assert rollout_gaps(model, mesh, BATCHES) == [0.0, 0.0, 0.0]
    off, mesh = model_for(None, deepseek[family][0], 1, dtype, False, "none")
    assert max(rollout_gaps(off, mesh, BATCHES)) > 0.0, "without the mode the two forwards must differ (the control)"


@pytest.mark.parametrize("mode", MODES)
def test_deepseek_heads_cache_eager(deepseek, mode):
    model, mesh = model_for(None, deepseek["deepseek_v3"][0], 1, "float32", mode, "none", mla_cache="heads")
    assert rollout_gaps(model, mesh, BATCHES) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("mode", MODES)
def test_deepseek_rollout_logprobs_equal_training_forward_tp2(world2, deepseek, mode):
    on = world2.run(gaps_on_rank, deepseek["deepseek_v3"][0], 2, "float32", mode, expert_axes=("tp",))
    assert on == [[0.0, 0.0, 0.0]] * 2
    off = world2.run(gaps_on_rank, deepseek["deepseek_v3"][0], 2, "float32", False, expert_axes=("tp",))
    assert max(max(g) for g in off) > 0.0


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_yarn", "deepseek_v2"])
@pytest.mark.parametrize("mode", MODES)
def test_deepseek_invariant_forward_is_close_to_transformers(deepseek, family, mode):
    close_to_transformers(*deepseek[family], mode)
