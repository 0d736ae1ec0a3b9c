"""A training batch checked at the boundary of the training entry points (``value_and_grad``, a compiled train step),
before anything is traced or exchanged, so a bad batch is one line naming what is wrong, in eager and compiled runs
alike, not an index error deep in the forward or a NaN loss.

The forms it knows: a token tensor ``[B, S]`` (``lm_loss``'s and ``token_logprobs``' batch: the ids are also the
labels of the next-token loss) and a :class:`PolicyBatch` (GRPO's rollouts, :mod:`.policy`). Any other batch is the loss
function's own and is passed through unchecked.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["PolicyBatch", "check_batch", "check_tokens", "check_token_shape", "check_ids"]


class PolicyBatch(NamedTuple):
    """One rank's rollouts as a training batch.

    Attributes:
        tokens: ``[B, S]`` prompt then completion, right-padded with 0.
        mask: ``[B, S - 1]`` 1.0 where position ``t`` predicts a completion token ``tokens[:, t + 1]``, else 0.
        advantages: ``[B]`` each sequence's advantage.
        old_logprobs: ``[B, S - 1]`` the rollout's log-probability of ``tokens[:, t + 1]`` under the mask, else 0.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor


def check_batch(batch: Any, vocab_size: int, device: torch.device, where: str) -> None:
    """Raise a TypeError / ValueError naming the first thing wrong with ``batch`` for a model of ``vocab_size`` tokens
    whose params are on ``device`` (see the module docstring)."""
    if isinstance(batch, PolicyBatch):
        _check_policy(batch, vocab_size, device, where)
    elif isinstance(batch, (torch.Tensor, list, tuple)) and not _structured(batch):
        check_tokens(batch, vocab_size, device, f"{where}: the batch")


def _structured(batch: Any) -> bool:
    """A tuple or list of tensors (a loss function's own batch form), not token ids written as a list."""
    return isinstance(batch, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in batch)


def check_tokens(tokens: Any, vocab_size: int, device: torch.device, what: str) -> None:
    """``tokens``: a 2-D integer tensor ``[B, S]`` with ``B >= 1`` sequences of ``S >= 2`` tokens (the next-token loss
    predicts ``S - 1`` of them), every id in ``[0, vocab_size)``, on ``device``."""
    check_token_shape(tokens, what)
    if tokens.device != device:
        raise ValueError(f"{what} is on {tokens.device}, the params on {device}; move it with .to({str(device)!r})")
    check_ids(tokens, vocab_size, what)


def check_token_shape(tokens: Any, what: str, min_length: int = 2) -> None:
    """``tokens``: a 2-D integer tensor of at least one sequence of ``min_length`` tokens (no value is read: this
    costs no device sync)."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(
            f"{what} is a {type(tokens).__name__}; give token ids as an integer tensor [batch, sequence], "
            f"torch.tensor(ids, dtype=torch.long)"
        )
    if tokens.dtype in (torch.bool,) or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
        raise TypeError(f"{what} is {tokens.dtype}; token ids are integers: pass them as torch.long")
    if tokens.dim() != 2:
        raise ValueError(f"{what} has shape {tuple(tokens.shape)}; token ids are 2-D [batch, sequence]")
    b, s = tokens.shape
    if b < 1 or s < min_length:
        why = " (the loss predicts each token from the ones before it)" if min_length > 1 else ""
        raise ValueError(
            f"{what} has shape {(b, s)}; it needs at least 1 sequence of at least {min_length} "
            f"token{'s' * (min_length > 1)}{why}"
        )


def check_ids(tokens: torch.Tensor, vocab_size: int, what: str) -> None:
    """Every id of ``tokens`` in ``[0, vocab_size)`` (reads the ids: a device sync for tokens off the CPU)."""
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"{what} holds token id {bad}, outside the vocabulary [0, {vocab_size}); tokenize with this model's "
            f"tokenizer"
        )


def _check_policy(batch: PolicyBatch, vocab_size: int, device: torch.device, where: str) -> None:
    check_tokens(batch.tokens, vocab_size, device, f"{where}: the batch's tokens")
    b, s = batch.tokens.shape
    want = {"mask": (b, s - 1), "advantages": (b,), "old_logprobs": (b, s - 1)}
    for name, shape in want.items():
        x = getattr(batch, name)
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or tuple(x.shape) != shape:
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{where}: the batch's {name} is {got}; it must be a float tensor {shape} (policy_batch)")
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{where}: the batch's {name} holds NaN or Inf; check the rewards and the rollout")
    if not bool((batch.mask > 0).any()):
        raise ValueError(
            f"{where}: the batch's mask selects no completion token, so the loss has nothing to average; give "
            f"rollouts with at least one completion token"
        )
