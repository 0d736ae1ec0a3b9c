"""The training entry points check their batch and params at the boundary: one line naming what is wrong, the same
from value_and_grad and a compiled train step (before anything is traced), never an index error from the forward,
dynamo's text or a NaN loss."""

import dataclasses

import pytest
import torch

from functional_npu import AdamW, Mesh, compile_train_step, lm_loss, shard, value_and_grad
from functional_npu.models import llama
from functional_npu.runtime.training import PolicyBatch, grpo_loss

from ..support.configs import DENSE

MESH = Mesh.abstract({"tp": 1}, 0)
V = DENSE.vocab_size


@pytest.fixture(scope="module")
def params():
    return shard(llama.init_params(DENSE, seed=1), llama.param_specs(DENSE), MESH)


@pytest.fixture(scope="module")
def step(params):
    return compile_train_step(lm_loss, AdamW(), params, MESH, backend="inductor")


BAD_TOKENS = [
    ([[1, 2, 3]], TypeError, r"the batch is a list; give token ids as an integer tensor \[batch, sequence\]"),
    (torch.ones(2, 4), TypeError, r"the batch is torch.float32; token ids are integers: pass them as torch.long"),
    (torch.ones(2, 4, dtype=torch.bool), TypeError, r"the batch is torch.bool; token ids are integers"),
    (torch.ones(4, dtype=torch.long), ValueError, r"the batch has shape \(4,\); token ids are 2-D \[batch, sequence\]"),
    (torch.ones(1, 2, 3, dtype=torch.long), ValueError, r"the batch has shape \(1, 2, 3\); token ids are 2-D"),
    (torch.ones(0, 4, dtype=torch.long), ValueError, r"the batch has shape \(0, 4\); it needs at least 1 sequence"),
    (torch.ones(2, 1, dtype=torch.long), ValueError, r"the batch has shape \(2, 1\); it needs at least 1 sequence"),
    (torch.tensor([[1, V]]), ValueError, rf"the batch holds token id {V}, outside the vocabulary \[0, {V}\)"),
    (torch.tensor([[-1, 2]]), ValueError, rf"the batch holds token id -1, outside the vocabulary \[0, {V}\)"),
    (torch.ones(1, 3, dtype=torch.long, device="meta"), ValueError, r"the batch is on meta, the params on cpu"),
]


@pytest.mark.parametrize("tokens, error, message", BAD_TOKENS, ids=lambda x: None)
def test_a_bad_token_batch_is_one_line_from_every_entry_point(params, step, tokens, error, message):
    with pytest.raises(error, match=r"^value_and_grad: " + message):
        value_and_grad(lm_loss)(params, tokens, MESH)
    with pytest.raises(error, match=r"^train step: " + message):  # before the compiled step is traced
        step(params, step.init(params), tokens)


def test_a_good_batch_trains():
    """The checks pass what the step takes (the counterpart of every refusal above)."""
    p = shard(llama.init_params(DENSE, seed=1), llama.param_specs(DENSE), MESH)
    loss, grads = value_and_grad(lm_loss)(p, torch.tensor([[1, 2, 3, V - 1]]), MESH)
    assert torch.isfinite(loss) and grads["embed"].shape == p["embed"].shape


def _policy(**changes):
    b, s = 2, 5
    batch = PolicyBatch(
        torch.randint(0, V, (b, s)), torch.ones(b, s - 1), torch.tensor([0.5, -0.5]), -torch.ones(b, s - 1)
    )
    return batch._replace(**changes)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"mask": torch.zeros(2, 4)}, r"the batch's mask selects no completion token, so the loss has nothing"),
        ({"mask": torch.ones(2, 5)}, r"the batch's mask is \(2, 5\) torch.float32; it must be a float tensor \(2, 4\)"),
        ({"advantages": torch.tensor([float("nan"), 0.0])}, r"the batch's advantages holds NaN or Inf"),
        ({"tokens": torch.full((2, 5), V)}, rf"the batch's tokens holds token id {V}, outside the vocabulary"),
    ],
)
def test_a_bad_policy_batch_is_one_line(params, changes, message):
    with pytest.raises(ValueError, match=r"^value_and_grad: " + message):
        value_and_grad(grpo_loss)(params, _policy(**changes), MESH)


def test_params_of_mixed_dtypes_or_an_integer_leaf_are_refused_by_name(params):
    mixed = params | {"norm": params["norm"].to(torch.bfloat16)}
    with pytest.raises(ValueError, match=r"params\['norm'\] is torch.bfloat16, params\['embed'\] torch.float32: every"):
        value_and_grad(lm_loss)(mixed, torch.ones(1, 3, dtype=torch.long), MESH)
    ints = params | {"norm": params["norm"].to(torch.int64)}
    with pytest.raises(ValueError, match=r"params\['norm'\] is torch.int64, not floating point; gradients need"):
        compile_train_step(lm_loss, AdamW(), ints, MESH, backend="none")
    assert dataclasses.is_dataclass(DENSE)
