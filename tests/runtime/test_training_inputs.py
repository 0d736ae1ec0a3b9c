"""The training faces refuse a hostile argument in one line naming the function, the argument, the bad value and a fix:
the forward's inputs (token_logprobs, lm_loss), the GRPO pieces (group_advantages, policy_batch, grpo_loss,
logprob_gap), AdamW's init and clipping, and the loss function of value_and_grad / compile_train_step. Tiny llama,
eager, nothing compiled."""

import math
import re

import pytest
import torch

from functional_npu import Mesh
from functional_npu.models.llama import init_params
from functional_npu.runtime.serving.generate import Samples
from functional_npu.runtime.training import (
    AdamW,
    PolicyBatch,
    compile_train_step,
    group_advantages,
    grpo_loss,
    lm_loss,
    logits,
    logprob_gap,
    policy_batch,
    token_logprobs,
    value_and_grad,
)

from ..support.configs import TINY as CFG

PARAMS = init_params(CFG, seed=0)
MESH = Mesh.abstract({"tp": 1}, 0)
TOKENS = torch.tensor([[1, 2, 3, 4, 5]])
BATCH = PolicyBatch(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 2), torch.ones(1), torch.zeros(1, 2))


def _rollout(logprobs, **kw):
    return policy_batch([[1, 2]], Samples([[3, 4]], [logprobs]), [0.7], **kw)


TEMPERATURE = (
    "token_logprobs: temperature must be a finite number >= 1e-06 (the rollout's sampling temperature; a greedy "
    "rollout's log-probabilities are at 1.0), got "
)
PARAMS_TYPE = (
    "params must be a functional_npu.Params with a model config (load_checkpoint's, or Params(tree, config)), got dict"
)
LOSS_FN = "loss_fn must be a function (params, batch, mesh) -> this rank's scalar loss, such as lm_loss; got NoneType"
DTYPE = (
    "policy_batch: dtype must be a floating-point torch.dtype (the mask, advantages and log-probabilities are "
    "fractions), got "
)
LOGPROB = "is not a finite number <= 0; pass the log-probabilities the rollout sampled with (Samples.logprobs)"
REWARDS = "group_advantages: rewards must be a floating-point tensor [groups, completions], got "
TO_FLOAT = "; convert them with torch.tensor(rewards, dtype=torch.float32)"
EPS = (
    "group_advantages: eps must be a finite number > 0 (added to each group's standard deviation: a group of equal "
    "rewards gets zeros, not 0/0), got "
)
CLIP = "grpo_loss: clip must be a finite number >= 0 (the ratio's trust region 1 +- clip; GRPO uses 0.2), got "
NORM = "norm is {}; a global norm is a finite number >= 0 (global_norm's of the gradients); a NaN or infinite one "
NORM += "comes from a non-finite gradient: skip that step, as compile_train_step does"
NOTHING = "; pass the params tree (load_checkpoint's) and the paths of the leaves to train"

REFUSED = [
    # row 6: more positions than the model has
    (
        lambda: token_logprobs(PARAMS, torch.randint(0, 64, (1, 80)), MESH),
        ValueError,
        "token_logprobs: tokens hold 80 positions, more than the model's 64 (max_position_embeddings); split or "
        "truncate the sequences to at most 64 tokens",
    ),
    (
        lambda: lm_loss(PARAMS, torch.randint(0, 64, (2, 65)), MESH),
        ValueError,
        "lm_loss: tokens hold 65 positions, more than the model's 64 (max_position_embeddings); split or truncate "
        "the sequences to at most 64 tokens",
    ),
    # row 7: one-token sequences (a NaN mean before)
    (
        lambda: lm_loss(PARAMS, torch.tensor([[1]]), MESH),
        ValueError,
        "lm_loss: tokens has shape (1, 1); it needs at least 1 sequence of at least 2 tokens (the loss predicts each "
        "token from the ones before it)",
    ),
    (
        lambda: token_logprobs(PARAMS, torch.tensor([[1], [2]]), MESH),
        ValueError,
        "token_logprobs: tokens has shape (2, 1); it needs at least 1 sequence of at least 2 tokens (the loss "
        "predicts each token from the ones before it)",
    ),
    (
        lambda: logits(PARAMS, torch.zeros(1, 0, dtype=torch.long), MESH),
        ValueError,
        "logits: tokens has shape (1, 0); it needs at least 1 sequence of at least 1 token",
    ),
    # row 8: temperature
    (lambda: token_logprobs(PARAMS, TOKENS, MESH, temperature=0), ValueError, TEMPERATURE + "0"),
    (lambda: token_logprobs(PARAMS, TOKENS, MESH, temperature=-1.0), ValueError, TEMPERATURE + "-1.0"),
    (lambda: token_logprobs(PARAMS, TOKENS, MESH, temperature=math.nan), ValueError, TEMPERATURE + "nan"),
    (lambda: token_logprobs(PARAMS, TOKENS, MESH, temperature=math.inf), ValueError, TEMPERATURE + "inf"),
    (
        lambda: token_logprobs(PARAMS, TOKENS, MESH, temperature="1"),
        TypeError,
        "token_logprobs: temperature must be a number (the rollout's sampling temperature), got str '1'",
    ),
    # row 35: tokens, mesh and params of the wrong kind
    (
        lambda: token_logprobs(PARAMS, torch.tensor([1, 2, 3]), MESH),
        ValueError,
        "token_logprobs: tokens has shape (3,); token ids are 2-D [batch, sequence]",
    ),
    (
        lambda: lm_loss(PARAMS, torch.tensor([[1.0, 2.0]]), MESH),
        TypeError,
        "lm_loss: tokens is torch.float32; token ids are integers: pass them as torch.long",
    ),
    (
        lambda: lm_loss(PARAMS, torch.tensor([[True, False]]), MESH),
        TypeError,
        "lm_loss: tokens is torch.bool; token ids are integers: pass them as torch.long",
    ),
    (
        lambda: token_logprobs(PARAMS, [[1, 2, 3]], MESH),
        TypeError,
        "token_logprobs: tokens is a list; give token ids as an integer tensor [batch, sequence], "
        "torch.tensor(ids, dtype=torch.long)",
    ),
    (
        lambda: token_logprobs(PARAMS, torch.tensor([[1, 999, 3]]), MESH),
        ValueError,
        "token_logprobs: tokens holds token id 999, outside the vocabulary [0, 64); tokenize with this model's "
        "tokenizer",
    ),
    (
        lambda: lm_loss(PARAMS, torch.tensor([[1, -7, 3]]), MESH),
        ValueError,
        "lm_loss: tokens holds token id -7, outside the vocabulary [0, 64); tokenize with this model's tokenizer",
    ),
    (
        lambda: token_logprobs(PARAMS, TOKENS, None),
        TypeError,
        "token_logprobs: mesh must be a functional_npu.Mesh (Mesh.abstract({'tp': 1}, 0) for one process), got "
        "NoneType",
    ),
    (lambda: token_logprobs(dict(PARAMS.items()), TOKENS, MESH), TypeError, "token_logprobs: " + PARAMS_TYPE),
    (lambda: lm_loss(dict(PARAMS.items()), TOKENS, MESH), TypeError, "lm_loss: " + PARAMS_TYPE),
    # rows 9 and 10: policy_batch
    (
        lambda: _rollout([-7.0]),
        ValueError,
        "policy_batch: sample 0 has 2 completion tokens but 1 log-probabilities; give one per completion token "
        "(Samples.logprobs as the rollout returned them)",
    ),
    (
        lambda: policy_batch([[1], [1, 2]], Samples([[3], [3, 4]], [[-1.0], [-1.0, -2.0, -3.0]]), [0.5, 0.5]),
        ValueError,
        "policy_batch: sample 1 has 2 completion tokens but 3 log-probabilities; give one per completion token "
        "(Samples.logprobs as the rollout returned them)",
    ),
    (lambda: _rollout([-1.0, -1.0], dtype=torch.int64), TypeError, DTYPE + "torch.int64; use torch.float32"),
    (lambda: _rollout([-1.0, -1.0], dtype="float32"), TypeError, DTYPE + "'float32'; use torch.float32"),
    (
        lambda: _rollout([-1.0, 0.5]),
        ValueError,
        "policy_batch: sample 0's log-probability 0.5 (completion token 1) " + LOGPROB,
    ),
    (
        lambda: _rollout([math.nan, -1.0]),
        ValueError,
        "policy_batch: sample 0's log-probability nan (completion token 0) " + LOGPROB,
    ),
    (
        lambda: _rollout([-1.0, -math.inf]),
        ValueError,
        "policy_batch: sample 0's log-probability -inf (completion token 1) " + LOGPROB,
    ),
    (
        lambda: policy_batch([], Samples([], []), []),
        ValueError,
        "policy_batch: no rollouts; give at least one prompt with its completion",
    ),
    (
        lambda: policy_batch([[]], Samples([[3, 4]], [[-1.0, -1.0]]), [0.7]),
        ValueError,
        "policy_batch: prompt 0 is empty; a completion is predicted from at least one token",
    ),
    # row 23: the norm AdamW clips by
    (lambda: AdamW().clip_scale(torch.tensor(-5.0)), ValueError, "AdamW.clip_scale: " + NORM.format("-5.0")),
    (lambda: AdamW().clip_scale(torch.tensor(math.nan)), ValueError, "AdamW.clip_scale: " + NORM.format("nan")),
    (lambda: AdamW().clip_scale(torch.tensor(math.inf)), ValueError, "AdamW.clip_scale: " + NORM.format("inf")),
    (
        lambda: AdamW().clip_scale(5.0),
        TypeError,
        "AdamW.clip_scale: norm must be a 0-d tensor (global_norm's), got float",
    ),
    (
        lambda: AdamW().update(PARAMS, _zero_grads(), AdamW().init(PARAMS), torch.tensor(-1.0)),
        ValueError,
        "AdamW.update: norm is -1.0; a global norm is a number >= 0 (global_norm's of the gradients)",
    ),
    # row 27: nothing to train
    (
        lambda: AdamW().init({}),
        ValueError,
        "AdamW.init: nothing to train: params hold no floating-point tensor" + NOTHING,
    ),
    (
        lambda: AdamW().init(None),
        TypeError,
        "AdamW.init: params must be the params tree (a dict of tensors), got NoneType",
    ),
    (
        lambda: AdamW().init(PARAMS, grads_of={"bogus"}),
        ValueError,
        "AdamW.init: grads_of names 'bogus', which is no floating-point leaf of params; name paths of float leaves "
        "(as value_and_grad's gradient tree has them), or pass None for every float leaf",
    ),
    (
        lambda: AdamW().init(PARAMS, grads_of=set()),
        ValueError,
        "AdamW.init: nothing to train: grads_of is empty" + NOTHING,
    ),
    (
        lambda: AdamW().init(PARAMS, grads_of="embed"),
        TypeError,
        "AdamW.init: grads_of must be a set of param paths (None: every float leaf), got 'embed'",
    ),
    # also seen: the GRPO pieces and the loss function
    (lambda: group_advantages(torch.ones(2, 3, dtype=torch.int64)), TypeError, REWARDS + "torch.int64" + TO_FLOAT),
    (lambda: group_advantages(torch.ones(2, 3, dtype=torch.bool)), TypeError, REWARDS + "torch.bool" + TO_FLOAT),
    (lambda: group_advantages([[1.0, 2.0]]), TypeError, REWARDS + "list" + TO_FLOAT),
    (lambda: group_advantages(torch.ones(2, 3), eps=0), ValueError, EPS + "0"),
    (lambda: group_advantages(torch.ones(2, 3), eps=-1e-6), ValueError, EPS + "-1e-06"),
    (lambda: group_advantages(torch.ones(2, 3), eps="x"), TypeError, EPS + "str 'x'"),
    (lambda: grpo_loss(PARAMS, _rollout([-1.0, -1.0]), MESH, clip=-1), ValueError, CLIP + "-1"),
    (lambda: grpo_loss(PARAMS, _rollout([-1.0, -1.0]), MESH, clip=math.nan), ValueError, CLIP + "nan"),
    (
        lambda: grpo_loss(PARAMS, TOKENS, MESH),
        TypeError,
        "grpo_loss: batch must be a PolicyBatch (policy_batch(...)), got Tensor",
    ),
    (
        lambda: logprob_gap(torch.zeros(1, 3), BATCH),
        ValueError,
        "logprob_gap: new has shape (1, 3) but the batch's old_logprobs (1, 2); pass token_logprobs(params, "
        "batch.tokens, mesh) of this batch",
    ),
    (
        lambda: logprob_gap([0.0], BATCH),
        TypeError,
        "logprob_gap: new must be a tensor (token_logprobs'), got list",
    ),
    (
        lambda: compile_train_step(None, AdamW(), PARAMS, MESH, backend="none"),
        TypeError,
        "compile_train_step: " + LOSS_FN,
    ),
    (lambda: value_and_grad(None), TypeError, "value_and_grad: " + LOSS_FN),
]


def _zero_grads():
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in PARAMS.items()} | {
        "layers": [{k: torch.zeros_like(v) for k, v in layer.items()} for layer in PARAMS["layers"]]
    }


@pytest.mark.parametrize("call, error, message", REFUSED, ids=range(len(REFUSED)))
def test_a_hostile_argument_is_refused_in_one_line(call, error, message):
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        call()


def test_policy_batch_of_good_rollouts_is_as_before():
    b = policy_batch([[1, 2], [3, 4, 5]], Samples([[7, 8, 9], [6]], [[-1.0, -2.0, -3.0], [0.0]]), [0.5, -0.5])
    assert b.tokens.tolist() == [[1, 2, 7, 8, 9], [3, 4, 5, 6, 0]]
    assert b.mask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]
    assert b.old_logprobs.tolist() == [[0, -1, -2, -3], [0, 0, 0, 0]]
    assert b.advantages.tolist() == [0.5, -0.5] and b.mask.dtype == torch.float32
    assert _rollout([-1.0, -2.0], dtype=torch.float64).old_logprobs.tolist() == [[0.0, -1.0, -2.0]]


def test_good_inputs_still_give_finite_answers():
    assert torch.isfinite(lm_loss(PARAMS, torch.tensor([[1, 2, 63]]), MESH))
    assert token_logprobs(PARAMS, torch.randint(0, 64, (1, 64)), MESH, temperature=1e-6).shape == (1, 63)
    assert logits(PARAMS, torch.tensor([[1]]), MESH).shape == (1, 1, 64)
    assert group_advantages(torch.ones(2, 3)).abs().max() == 0  # equal rewards: zeros, not NaN
    assert float(AdamW(max_grad_norm=1.0).clip_scale(torch.tensor(4.0))) == pytest.approx(0.25, rel=1e-5)
    assert set(AdamW().init(PARAMS, grads_of={"embed"}).mu["layers"][0].values()) == {None}


def test_update_leaves_a_non_finite_gradient_to_the_train_step():
    """Not refused by update (finding it would cost a device sync each step): every param goes NaN, as documented;
    compile_train_step refuses such a step (tests/runtime/test_train_step.py)."""
    grads = _zero_grads() | {"norm": torch.full_like(PARAMS["norm"], math.nan)}
    new, _ = AdamW().update(PARAMS, grads, AdamW().init(PARAMS), torch.tensor(math.nan))
    assert new["embed"].isnan().all()
