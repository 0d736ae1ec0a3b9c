"""The one generation path: chunks of prompts, a padded prefill, decode steps, sampling, lockstep.

Every way to generate (``CompiledModel.generate`` under any backend, :func:`~functional_npu.greedy_generate`,
the CLI's ranks) runs :func:`generate` over a model's ``new_state`` / ``prefill`` / ``decode``. Prompts
of different lengths are right-padded into one batch; each sequence decodes at its own position, so
a padded batch gives the same tokens as running each prompt alone.

Ranks that share a collective step (the ranks of a layer-sharded series axis share every weight
broadcast; the ranks of an expert axis exchange tokens) must make the same calls with the same
shapes. :class:`Lockstep` says how: every such rank runs the same number of chunks of the same batch
and prompt-length bucket, filling with dummy one-token prompts whose results are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from ...core.numbers import is_int, require_int
from ...models.decoder import DecodeState
from ...models.invariant_modes import ops as invariant_ops_of
from ...parallel.plan import Plan
from ...parallel.prefetch import drain

MIN_TEMPERATURE = 1e-6  # the smallest sampling temperature (logits / temperature must stay finite)

__all__ = [
    "MIN_TEMPERATURE",
    "Lockstep",
    "Samples",
    "generate",
    "sample",
    "logprobs_of",
    "sampler",
    "check_sampling",
    "check_token_ids",
    "check_length",
]


class Model(Protocol):
    """What generation needs of a model (:class:`~functional_npu.runtime.serving.compiled_model.CompiledModel`)."""

    batch_sizes: tuple[int, ...]
    max_seq_len: int
    config: Any
    plan: Plan

    def new_state(self, batch: int) -> DecodeState: ...
    def prefill(self, prompts: Sequence[Sequence[int]], state: DecodeState, *, length: int = 0) -> torch.Tensor: ...
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, state: DecodeState) -> torch.Tensor: ...
    @property
    def greedy_head(self) -> bool: ...
    def decode_greedy(self, tokens: torch.Tensor, positions: torch.Tensor, state: DecodeState) -> torch.Tensor: ...


@dataclass(frozen=True)
class Lockstep:
    """Every rank of a group runs ``chunks`` chunks of ``batch`` rows, prefilled at the bucket of ``prompt_len``."""

    chunks: int
    batch: int
    prompt_len: int

    def __post_init__(self) -> None:
        for name in ("chunks", "batch", "prompt_len"):
            require_int(getattr(self, name), f"Lockstep: {name}", 1, "as Lockstep.over gives them")

    @staticmethod
    def over(prompts: int, ranks: int, longest: int, batch_sizes: Sequence[int]) -> Lockstep:
        """The lockstep of ``prompts`` prompts dealt round-robin to ``ranks`` ranks (the busiest one sets it).

        Raises:
            ValueError / TypeError naming the argument: ``prompts`` or ``longest`` below 0, ``ranks`` below 1, or
            ``batch_sizes`` not a non-empty list of positive ints.
        """
        require_int(prompts, "Lockstep.over: prompts", 0, "the number of prompts over all ranks")
        require_int(ranks, "Lockstep.over: ranks", 1, "the ranks that share the steps")
        require_int(longest, "Lockstep.over: longest", 0, "the longest prompt's tokens")
        if not batch_sizes or not all(is_int(b, 1) for b in batch_sizes):
            raise ValueError(
                f"Lockstep.over: batch_sizes must be a non-empty list of positive ints (the model's batch_sizes), "
                f"got {list(batch_sizes)}"
            )
        busiest = max(1, math.ceil(prompts / ranks))
        width = max(batch_sizes)
        batch = min(b for b in batch_sizes if b >= min(busiest, width))
        return Lockstep(math.ceil(busiest / width), batch, max(1, longest))


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, V]`` -> each row's first largest logit's id ``[B]`` (greedy decoding)."""
    return logits.argmax(-1)


def _picked(logits: torch.Tensor, pick: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, finite)``: ``pick(logits)`` and whether the logits can be trusted. Greedy takes one pass over the
    logits (``max`` gives each row's largest value and its first index; a row holding a NaN or an Inf has a NaN or
    an infinite max, unless its only non-finite values are -Inf beside finite ones, which pick nothing); a sampler
    checks every logit."""
    if pick is greedy_pick:
        values, tokens = logits.max(-1)
        return tokens, torch.isfinite(values).all()
    return pick(logits), torch.isfinite(logits).all()


def sampler(
    temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Logits ``[B, V]`` -> token ids ``[B]``: argmax when ``temperature == 0``, else seeded top-k / top-p sampling.

    Raises:
        ValueError naming the setting for a temperature that is not a finite number >= 0, a top_k below 1, a top_p
        outside (0, 1], or a seed outside torch's generator range [0, 2**64).
    """
    check_sampling(temperature, top_k, top_p, seed)
    if temperature == 0:
        return greedy_pick
    gens: dict[torch.device, torch.Generator] = {}  # one seeded generator on the logits' device

    def generator(device: torch.device) -> torch.Generator | None:
        if seed is not None and device not in gens:
            gens[device] = torch.Generator(device).manual_seed(seed)
        return gens.get(device)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float() / temperature
        if top_k is not None:
            kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p is not None:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix with mass >= top_p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator(logits.device))[:, 0]

    return sample


def check_sampling(temperature: Any, top_k: Any, top_p: Any, seed: Any) -> None:
    """Raise a ValueError naming the first sampling setting a sampler cannot use (see :func:`sampler`)."""

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    def integer(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not (number(temperature) and (temperature == 0 or temperature >= MIN_TEMPERATURE)):
        raise ValueError(
            f"sampling: temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} (below it the scaled "
            f"logits overflow), got {temperature!r}"
        )
    if top_k is not None and not (integer(top_k) and top_k >= 1):
        raise ValueError(f"sampling: top_k must be an int >= 1 (None: all tokens), got {top_k!r}")
    if top_p is not None and not (number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"sampling: top_p must be a number in (0, 1] (None: no cut), got {top_p!r}")
    if seed is not None and not (integer(seed) and 0 <= seed < 2**64):
        raise ValueError(f"sampling: seed must be an int in [0, 2**64) (torch's generator range), got {seed!r}")


def _int(x: Any) -> bool:
    """An int token id (a Python int or a 0-d integer tensor), not a bool or a float."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.dtype.is_floating_point and x.dtype != torch.bool
    return isinstance(x, int) and not isinstance(x, bool)


def check_length(prompt_len: int, max_new_tokens: int, max_positions: int) -> None:
    """Raise a ValueError when a generation would run past the positions the model was built for."""
    if prompt_len + max_new_tokens > max_positions:
        if prompt_len < max_positions:
            fix = f"lower max_new_tokens to at most {max_positions - prompt_len} or shorten the prompt"
        elif max_new_tokens < max_positions:
            fix = f"shorten the prompt to at most {max_positions - max_new_tokens} tokens"
        else:
            fix = f"shorten the prompt and lower max_new_tokens to at most {max_positions} together"
        raise ValueError(
            f"generate: {prompt_len} prompt tokens + {max_new_tokens} new exceed the model's {max_positions} positions "
            f"(max_position_embeddings); {fix}"
        )


def check_token_ids(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Raise a TypeError naming the first prompt that is not a sequence of ints, a ValueError naming the first with
    a token id outside ``[0, vocab_size)`` (or no tokens)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"generate: prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise TypeError(f"generate: prompt {i} is a {type(p).__name__}; give a list of int token ids")
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty; every prompt needs at least one token")
        wrong = next((t for t in p if not _int(t)), None)
        if wrong is not None:
            raise TypeError(f"generate: prompt {i} holds {wrong!r} ({type(wrong).__name__}); token ids are ints")
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(
                f"generate: prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size}); "
                "tokenize with this model's tokenizer"
            )


def _chunk(
    model: Model,
    rows: Sequence[Sequence[int]],
    new: int,
    pick: Callable[[torch.Tensor], torch.Tensor] | None,
    length: int,
    temperature: float | None = None,
) -> tuple[list[list[int]], list[list[float]] | None]:
    """``new`` tokens for each row of one batch: one prefill into a fresh state, then ``new - 1`` decode steps
    (``pick`` None: greedy steps through the model's greedy head, which returns tokens, -1 where non-finite);
    with a ``temperature``, also each token's log-probability under ``softmax(logits / temperature)``."""
    state = model.new_state(len(rows))
    logits = model.prefill(rows, state, length=length)
    step, finite = _picked(logits, greedy_pick if pick is None else pick)  # finite: checked once per chunk, no sync
    pos, steps = torch.tensor([len(p) for p in rows]), [step]
    scores = [] if temperature is None else [logprobs_of(logits, step, temperature, model.plan.invariant)]
    for _ in range(new - 1):
        if pick is None:
            step = model.decode_greedy(step, pos, state)
            finite &= (step >= 0).all()
        else:
            logits = model.decode(step, pos, state)
            step, ok = _picked(logits, pick)
            finite &= ok
            scores += [] if temperature is None else [logprobs_of(logits, step, temperature, model.plan.invariant)]
        pos = pos + 1
        steps.append(step)
    drain(state.prefetched)
    if not bool(finite):
        raise FloatingPointError(
            "generate: the model produced non-finite logits (NaN or Inf), so its tokens are meaningless; "
            "check the checkpoint's weights for NaN / Inf, or load them in a wider dtype (load_checkpoint(dtype=))"
        )
    return torch.stack(steps, dim=1).tolist(), torch.stack(scores, dim=1).tolist() if scores else None


def logprobs_of(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, invariant: bool | str = False
) -> torch.Tensor:
    """``logits [..., V]``, ``tokens [...]`` -> ``[...]``: log p(token) under ``softmax(logits / temperature)``, in
    float32 (float64 logits: float64). The rollout's and the training forward's log-probabilities both.
    ``invariant`` (a ``Plan.invariant`` mode): the logits times ``1 / temperature`` and that mode's ``log_softmax``
    (:mod:`functional_npu.models.invariant_modes`), the same bits compiled or not, whatever the rows beside them."""
    if invariant:
        logprobs = invariant_ops_of(invariant).log_softmax(logits.float() * (1.0 / temperature))
    else:
        logits = logits if logits.dtype == torch.float64 else logits.float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, tokens[..., None]).squeeze(-1)


class Samples(NamedTuple):
    """Generated tokens and, for each, its log-probability under the distribution it was drawn from
    (``softmax(logits / temperature)``; temperature 1 when greedy), as the decode path computed it."""

    tokens: list[list[int]]
    logprobs: list[list[float]]


def generate(
    model: Model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    lockstep: Lockstep | None = None,
    **sampling: Any,
) -> list[list[int]]:
    """``max_new_tokens`` new ids per prompt, in chunks of the largest batch bucket (or ``lockstep.batch``).

    ``sampling``: ``temperature``, ``top_k``, ``top_p``, ``seed`` (see :func:`sampler`).
    """
    return _generate(model, prompts, max_new_tokens, lockstep, False, sampling).tokens


def sample(
    model: Model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    lockstep: Lockstep | None = None,
    **sampling: Any,
) -> Samples:
    """:func:`generate`, and each new token's log-probability from the same logits it was drawn from (a
    rollout's behaviour log-probabilities; decode steps read the logits, never the greedy head)."""
    return _generate(model, prompts, max_new_tokens, lockstep, True, sampling)


def _generate(
    model: Model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    lockstep: Lockstep | None,
    logprobs: bool,
    sampling: dict[str, Any],
) -> Samples:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    check_token_ids(prompts, model.config.vocab_size)
    longest = max([len(p) for p in prompts] + [lockstep.prompt_len if lockstep else 0])
    if longest + max_new_tokens > model.max_seq_len:
        raise ValueError(
            f"generate: {longest} prompt tokens + {max_new_tokens} new exceed max_seq_len {model.max_seq_len}"
        )
    check_length(longest, max_new_tokens, model.config.max_position_embeddings)
    pick = sampler(**sampling)
    if model.greedy_head and not sampling.get("temperature") and not logprobs:  # decode steps move tokens, not logits
        pick = None
    temperature = (sampling.get("temperature") or 1.0) if logprobs else None
    width = lockstep.batch if lockstep else model.batch_sizes[-1]
    chunks = [list(prompts[i : i + width]) for i in range(0, len(prompts), width)]
    if lockstep is not None:
        if len(chunks) > lockstep.chunks:
            raise ValueError(
                f"generate: {len(prompts)} prompts need {len(chunks)} chunks of {width}, "
                f"more than the lockstep's {lockstep.chunks}"
            )
        chunks += [[]] * (lockstep.chunks - len(chunks))
    tokens: list[list[int]] = []
    scores: list[list[float]] = []
    for chunk in chunks:
        rows = chunk + [[0]] * (width - len(chunk)) if lockstep else chunk  # dummies keep the group's shapes
        t, lp = _chunk(model, rows, max_new_tokens, pick, lockstep.prompt_len if lockstep else 0, temperature)
        tokens += t[: len(chunk)]
        scores += lp[: len(chunk)] if lp is not None else []
    return Samples(tokens, scores)
