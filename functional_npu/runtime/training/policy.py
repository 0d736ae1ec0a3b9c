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

import math
from collections.abc import Sequence
from typing import Any

import torch

from ...core.mesh import Mesh
from ..serving.generate import Samples
from .batch import PolicyBatch
from .grad import token_logprobs

__all__ = ["PolicyBatch", "group_advantages", "policy_batch", "grpo_loss", "logprob_gap"]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``rewards [G, K]`` (K completions of each of G prompts) -> advantages ``[G, K]``: each reward less its
    group's mean, over the group's standard deviation (GRPO's; a group of equal rewards gives zeros).

    Raises:
        TypeError: rewards that are not a floating-point tensor. ValueError: rewards not ``[G, K >= 2]``, an ``eps``
        that is not a finite number > 0.
    """
    if not isinstance(rewards, torch.Tensor) or not rewards.dtype.is_floating_point:
        got = rewards.dtype if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise TypeError(
            f"group_advantages: rewards must be a floating-point tensor [groups, completions], got {got}; "
            f"convert them with torch.tensor(rewards, dtype=torch.float32)"
        )
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"group_advantages: rewards must be [groups, completions >= 2], got {tuple(rewards.shape)}")
    why = "(added to each group's standard deviation: a group of equal rewards gets zeros, not 0/0)"
    _check_number(eps, "group_advantages: eps", why, positive=True)
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)
    return (rewards - mean) / (std + eps)


def _check_number(value: Any, what: str, why: str, *, positive: bool) -> None:
    """``value`` a finite number, > 0 if ``positive`` else >= 0: a TypeError / ValueError naming ``what``."""
    bound = "> 0" if positive else ">= 0"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{what} must be a finite number {bound} {why}, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"{what} must be a finite number {bound} {why}, got {value!r}")


def policy_batch(
    prompts: Sequence[Sequence[int]],
    samples: Samples,
    advantages: Sequence[float],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> PolicyBatch:
    """The rollouts ``prompts[i] + samples.tokens[i]`` as a :class:`PolicyBatch` (one row per completion), on
    ``device``.

    Raises:
        TypeError: a ``dtype`` that is not a floating-point torch dtype. ValueError naming the sample: counts that
        differ, no rollout, an empty prompt, a log-probability row whose length is not its completion's, a
        log-probability that is not a finite number <= 0.
    """
    _check_rollouts(prompts, samples, advantages, dtype)
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


def _check_rollouts(
    prompts: Sequence[Sequence[int]], samples: Samples, advantages: Sequence[float], dtype: Any
) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"policy_batch: dtype must be a floating-point torch.dtype (the mask, advantages and log-probabilities "
            f"are fractions), got {dtype!r}; use torch.float32"
        )
    if not len(prompts) == len(samples.tokens) == len(samples.logprobs) == len(advantages):
        raise ValueError(
            f"policy_batch: {len(prompts)} prompts, {len(samples.tokens)} completions, {len(samples.logprobs)} "
            f"log-probability rows and {len(advantages)} advantages; give one of each per rollout"
        )
    if not prompts:
        raise ValueError("policy_batch: no rollouts; give at least one prompt with its completion")
    for i, (p, c, lp) in enumerate(zip(prompts, samples.tokens, samples.logprobs)):
        if not p:
            raise ValueError(f"policy_batch: prompt {i} is empty; a completion is predicted from at least one token")
        if len(lp) != len(c):
            raise ValueError(
                f"policy_batch: sample {i} has {len(c)} completion tokens but {len(lp)} log-probabilities; give one "
                f"per completion token (Samples.logprobs as the rollout returned them)"
            )
        bad = next((j for j, x in enumerate(lp) if not (math.isfinite(x) and x <= 0)), None)
        if bad is not None:
            raise ValueError(
                f"policy_batch: sample {i}'s log-probability {lp[bad]!r} (completion token {bad}) is not a finite "
                f"number <= 0; pass the log-probabilities the rollout sampled with (Samples.logprobs)"
            )


def grpo_loss(params: dict, batch: PolicyBatch, mesh: Mesh, *, clip: float = 0.2) -> torch.Tensor:
    """The clipped surrogate loss: ``-mean over completion tokens of min(r A, clip(r, 1 - clip, 1 + clip) A)``,
    ``r = exp(new log-prob - rollout log-prob)`` (this rank's batch; a train step averages over the ranks).

    Raises:
        TypeError: a batch that is not a :class:`PolicyBatch`. TypeError / ValueError: a ``clip`` that is not a
        finite number >= 0; the params, tokens or mesh, as :func:`~.grad.token_logprobs` refuses them.
    """
    if not isinstance(batch, PolicyBatch):
        raise TypeError(f"grpo_loss: batch must be a PolicyBatch (policy_batch(...)), got {type(batch).__name__}")
    _check_number(clip, "grpo_loss: clip", "(the ratio's trust region 1 +- clip; GRPO uses 0.2)", positive=False)
    new = token_logprobs(params, batch.tokens, mesh)
    ratio = torch.exp(new - batch.old_logprobs) * batch.mask
    a = batch.advantages[:, None].to(new.dtype)
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    return -(surrogate * batch.mask).sum() / batch.mask.sum()


def logprob_gap(new: torch.Tensor, batch: PolicyBatch) -> float:
    """The largest ``|new - rollout|`` log-probability over the completion tokens (``new [B, S - 1]``).

    Raises:
        TypeError: ``new`` is not a tensor. ValueError: ``new``'s shape is not the batch's ``old_logprobs``'.
    """
    if not isinstance(new, torch.Tensor):
        raise TypeError(f"logprob_gap: new must be a tensor (token_logprobs'), got {type(new).__name__}")
    if new.shape != batch.old_logprobs.shape:
        raise ValueError(
            f"logprob_gap: new has shape {tuple(new.shape)} but the batch's old_logprobs "
            f"{tuple(batch.old_logprobs.shape)}; pass token_logprobs(params, batch.tokens, mesh) of this batch"
        )
    return float(((new - batch.old_logprobs).abs() * batch.mask).max())
