"""The GRPO pieces: advantages within each group, the batch's mask over completion tokens, and the clipped
surrogate (on-policy its gradient is the advantage-weighted gradient of the completions' log-likelihood)."""

import pytest
import torch

from functional_npu import Mesh, load_checkpoint
from functional_npu.runtime.serving.generate import Samples
from functional_npu.runtime.training.grad import token_logprobs, value_and_grad
from functional_npu.runtime.training.policy import group_advantages, grpo_loss, policy_batch

from ..support.hf_models import save_tiny


def test_group_advantages_centre_and_scale_each_group():
    a = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) / (1 / 3) ** 0.5 * 0.5, atol=1e-5)
    assert a[1].abs().max() == 0
    with pytest.raises(ValueError, match=r"rewards must be \[groups, completions >= 2\], got \(4,\)"):
        group_advantages(torch.ones(4))


def test_policy_batch_masks_exactly_the_completion_tokens():
    b = policy_batch([[1, 2], [3, 4, 5]], Samples([[7, 8, 9], [6]], [[-1.0, -2.0, -3.0], [-4.0]]), [0.5, -0.5])
    assert b.tokens.tolist() == [[1, 2, 7, 8, 9], [3, 4, 5, 6, 0]]
    assert b.mask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]
    assert b.old_logprobs.tolist() == [[0, -1, -2, -3], [0, 0, -4, 0]]
    with pytest.raises(ValueError, match=r"policy_batch: 1 prompts, 2 completions"):
        policy_batch([[1]], Samples([[1], [2]], [[0.0], [0.0]]), [0.0, 0.0])


def test_on_policy_grpo_gradient_is_the_weighted_log_likelihood_gradient(tmp_path):
    save_tiny("qwen3", tmp_path, 31)
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = load_checkpoint(tmp_path, mesh, dtype=torch.float64)
    prompts, completions = [[1, 2, 3], [4, 5, 6]], [[7, 8], [9, 10]]
    seq = torch.tensor([p + c for p, c in zip(prompts, completions)])
    old = token_logprobs(params, seq, mesh)[:, 2:].tolist()
    batch = policy_batch(prompts, Samples(completions, old), [1.5, -0.5], dtype=torch.float64)
    loss, grads = value_and_grad(grpo_loss)(params, batch, mesh)

    def weighted(p, b, m):  # -sum(A * log p(completion)) / tokens: the on-policy surrogate's gradient
        return -(token_logprobs(p, b.tokens, m) * b.mask * b.advantages[:, None]).sum() / b.mask.sum()

    _, want = value_and_grad(weighted)(params, batch, mesh)
    assert abs(loss.item() + (1.5 - 0.5) / 2) < 1e-9  # ratios of 1: -mean of A over the tokens
    assert torch.allclose(grads["layers"][1]["qkv"], want["layers"][1]["qkv"], atol=1e-12)
    assert grads["layers"][1]["qkv"].abs().max() > 0
