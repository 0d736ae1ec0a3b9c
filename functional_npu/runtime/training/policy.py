"""A GRPO-style policy-gradient loss over rollouts, from the same pure forward the rollouts were sampled with.

A rollout samples ``K`` completions per prompt with a compiled inference model
(:meth:`~functional_npu.runtime.serving.CompiledModel.sample`, which keeps each token's log-probability from
the logits it was drawn from); a reward scores each completion; :func:`group_advantages` centres and scales
the rewards within each prompt's group; :func:`policy_batch` lays the sequences out as one batch with a mask
over the completion tokens; :func:`grpo_loss` is the clipped surrogate of the new log-probabilities (the
training forward, :func:`~functional_npu.runtime.training.grad.token_logprobs`) against the rollout's. It is an ordinary
``loss_fn`` for :func:`~functional_npu.runtime.training.grad.value_and_grad` and
:func:`~functional_npu.runtime.training.train_step.compile_train_step`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...core.mesh import Mesh
from ..serving.generate import Samples
from .batch import PolicyBatch
from .grad import token_logprobs

__all__ = ["PolicyBatch", "group_advantages", "policy_batch", "grpo_loss", "logprob_gap"]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``rewards [G, K]`` (K completions of each of G prompts) -> advantages ``[G, K]``: each reward less its
    group's mean, over the group's standard deviation (GRPO's; a group of equal rewards gives zeros)."""
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"group_advantages: rewards must be [groups, completions >= 2], got {tuple(rewards.shape)}")
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)
    return (rewards - mean) / (std + eps)


def policy_batch(
    prompts: Sequence[Sequence[int]],
    samples: Samples,
    advantages: Sequence[float],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> PolicyBatch:
    """The rollouts ``prompts[i] + samples.tokens[i]`` as a :class:`PolicyBatch` (one row per completion), on
    ``device``."""
    if not len(prompts) == len(samples.tokens) == len(samples.logprobs) == len(advantages):
        raise ValueError(
            f"policy_batch: {len(prompts)} prompts, {len(samples.tokens)} completions, {len(samples.logprobs)} "
            f"log-probability rows and {len(advantages)} advantages; give one of each per rollout"
        )
    width = max(len(p) + len(c) for p, c in zip(prompts, samples.tokens))
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width - 1, dtype=dtype)
    old = torch.zeros(len(prompts), width - 1, dtype=dtype)
    for i, (p, c, lp) in enumerate(zip(prompts, samples.tokens, samples.logprobs)):
        tokens[i, : len(p) + len(c)] = torch.tensor(list(p) + list(c))
        mask[i, len(p) - 1 : len(p) - 1 + len(c)] = 1.0
        old[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(lp, dtype=dtype)
    batch = PolicyBatch(tokens, mask, torch.tensor(list(advantages), dtype=dtype), old)
    return PolicyBatch(*(x.to(device) for x in batch))


def grpo_loss(params: dict, batch: PolicyBatch, mesh: Mesh, *, clip: float = 0.2) -> torch.Tensor:
    """The clipped surrogate loss: ``-mean over completion tokens of min(r A, clip(r, 1 - clip, 1 + clip) A)``,
    ``r = exp(new log-prob - rollout log-prob)`` (this rank's batch; a train step averages over the ranks)."""
    new = token_logprobs(params, batch.tokens, mesh)
    ratio = torch.exp(new - batch.old_logprobs) * batch.mask
    a = batch.advantages[:, None].to(new.dtype)
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    return -(surrogate * batch.mask).sum() / batch.mask.sum()


def logprob_gap(new: torch.Tensor, batch: PolicyBatch) -> float:
    """The largest ``|new - rollout|`` log-probability over the completion tokens (``new [B, S - 1]``)."""
    return float(((new - batch.old_logprobs).abs() * batch.mask).max())
