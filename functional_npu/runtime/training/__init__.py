"""Training over the sharded forward: gradients in the params' layouts, AdamW as a pure function, the compiled
train step, GRPO's pieces, and the weight sync from the training plan to the inference plan.

- :mod:`.grad`: ``value_and_grad``, ``token_logprobs``, ``lm_loss``;
- :mod:`.optim`: ``AdamW``;
- :mod:`.train_step`: ``compile_train_step``;
- :mod:`.policy`: GRPO's advantages, masked batch and clipped surrogate loss;
- :mod:`.weight_sync`: ``reshard_params``, params from one plan to another on the same ranks.
"""

from .grad import differentiable, lm_loss, logits, token_logprobs, value_and_grad
from .optim import AdamW, OptState
from .policy import PolicyBatch, group_advantages, grpo_loss, logprob_gap, policy_batch
from .train_step import StepStats, TrainStep, compile_train_step
from .weight_sync import plan_params_reshard, reshard_params

__all__ = [
    "value_and_grad",
    "logits",
    "token_logprobs",
    "lm_loss",
    "differentiable",
    "AdamW",
    "OptState",
    "compile_train_step",
    "TrainStep",
    "StepStats",
    "PolicyBatch",
    "group_advantages",
    "policy_batch",
    "grpo_loss",
    "logprob_gap",
    "reshard_params",
    "plan_params_reshard",
]
