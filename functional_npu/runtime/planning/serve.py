"""Served throughput: how many sequences a memory budget admits under a plan, and the tokens/s that batch serves.

A serving engine gives the KV cache the memory the weights leave, and freed memory pays only as more sequences
served at once. :func:`serve_estimate` prices a candidate that way for a ``serve`` workload
(:meth:`~.choose.Workload.serve`: sequences of ``context`` positions, a share of prompt tokens, an optional cap):

- **the batch admitted**: the most sequences whose bytes on the busiest rank fit the budget: the weights, the
  prefetch ring, every sequence's KV cache at its full context in the serving engine's paged pools (the blocks
  its budget buys, :func:`~functional_npu.models.paged.cache_bytes`), and
  the larger of a decode step's activations and a prefill's (one prompt per data-parallel rank). Bytes grow
  linearly with the sequences per rank, so two counts give the slope and the largest batch is checked exactly;
  the batch is a multiple of the data-parallel ranks (each takes as many) unless the cap is smaller;
- **tokens/s** (prompt and generated tokens, all ranks): decode steps of that batch at the sequences' mean
  context serve ``batch / step`` tokens/s, prefills of one prompt per data-parallel rank ``dp x prompt / step``;
  a mix with prompt share ``p`` serves ``1 / ((1 - p) / decode + p / prefill)``. Candidates are ranked by that
  per device;
- **the bottleneck**: the term the phase that takes most of the time waits on
  (:attr:`~.choose.Estimate.bottleneck`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...placement.placement import Placement
from ...placement.quant_config import QuantConfig
from .step_model import Candidate, Estimate, Workload, check_request, estimate

__all__ = ["Served", "serve_estimate"]


@dataclass(frozen=True)
class Served:
    """One candidate under a serving workload.

    Attributes:
        batch: the sequences served at once (0: not even one fits; ``bytes`` is then what one needs).
        tokens_per_s: prompt and generated tokens per second over all ranks; ``per_device``: that over the devices.
        decode: the decode step at ``batch`` (mean context); ``prefill``: one prompt per data-parallel rank (None:
            decode alone).
        bytes: on the busiest rank at ``batch``: ``weights``, ``kv_cache`` (full contexts), ``prefetch``,
            ``activations`` (the larger phase's), ``total``.
        bottleneck: what the phase taking most of the serving time waits on (:attr:`Estimate.bottleneck`).
    """

    candidate: Candidate
    batch: int
    tokens_per_s: float
    per_device: float
    decode: Estimate
    prefill: Estimate | None
    bytes: dict[str, int]
    fits: bool
    bottleneck: str
    placement: Placement = field(repr=False)

    @property
    def step_s(self) -> float:
        """The decode step's time at the admitted batch."""
        return self.decode.step_s

    @property
    def runs(self) -> bool:
        return self.candidate.runs

    def row(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "plan": self.candidate.name,
            "runs": self.runs,
            "axes": self.candidate.axes,
            "batch": self.batch,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_device": self.per_device,
            "decode_step_ms": self.decode.step_s * 1e3,
            "decode_parts_ms": {k: v * 1e3 for k, v in self.decode.parts.items()},
            "prefill_step_ms": self.prefill.step_s * 1e3 if self.prefill is not None else None,
            "bytes_per_rank": self.bytes,
            "bottleneck": self.bottleneck,
            "fits": self.fits,
        }


def serve_estimate(
    cfg: Any,
    candidate: Candidate,
    device: Any,
    workload: Workload,
    *,
    memory_per_device: float,
    quant: QuantConfig | None = None,
    dispatch: str = "runtime",
    decode_only: bool = False,
) -> Served:
    """``candidate``'s admitted batch, tokens/s and bytes under the serving ``workload`` (module docstring);
    ``dispatch`` as :func:`~.step_model.estimate`'s. ``decode_only``: the decode side of a disaggregated deployment
    (:mod:`.disaggregated`): its sequences arrive prefilled, so it runs no prefill and its tokens/s counts the
    generated tokens alone.

    Raises:
        ValueError: the model cannot run the candidate, or ``workload`` is not a serving one.
    """
    check_request(candidate, workload, memory_per_device, quant, dispatch, "serve_estimate")
    if workload.kind != "serve":
        raise ValueError(f"serve_estimate: needs a serving workload (Workload.serve), got {workload}")
    if memory_per_device == math.inf and workload.max_seqs is None:
        raise ValueError(
            "serve_estimate: memory_per_device=inf (unbounded) admits any number of sequences and the workload "
            "has no cap; give it one (Workload.serve(context, max_seqs=n)) or a finite memory budget in bytes"
        )
    dp, dtype = candidate.devices // candidate.axes.get(candidate.plan.tp, 1), workload.dtype

    settings = {"weights": workload.weights, "kv_dtype": workload.kv_dtype}
    drafts = {"draft_tokens": workload.draft_tokens, "acceptance": workload.acceptance}

    def step(work: Workload) -> Estimate:
        return estimate(cfg, candidate, device, work, quant=quant, dispatch=dispatch)

    prompt = workload.prompt_len
    mean = prompt + (workload.context - prompt) // 2  # a generated token's mean context
    prefilled = prompt and not decode_only
    prefill = step(Workload.prefill(prompt, dp, dtype).with_(**settings)) if prefilled else None  # a prompt per dp rank
    held = workload.context - 1 if workload.admit == "full" else mean  # what each admitted sequence's cache holds

    def need(per_rank: int) -> dict[str, int]:  # bytes on the busiest rank with ``per_rank`` sequences each
        full = step(Workload.decode(per_rank * dp, held, dtype).with_(**settings, **drafts))
        sizes = dict(full.bytes, activations=max(full.bytes["activations"], _activations(prefill)))
        sizes["total"] = sum(v for k, v in sizes.items() if k not in ("total", "host"))  # host bytes: not the device's
        return sizes

    per_rank = _admitted(need, memory_per_device, workload.max_seqs, dp)
    batch = per_rank * dp if workload.max_seqs is None else min(per_rank * dp, workload.max_seqs)
    decode = step(Workload.decode(max(1, batch), max(1, mean), dtype).with_(**settings, **drafts))
    share = 0.0 if decode_only else prompt / workload.context
    per_step = max(1, batch) * workload.tokens_per_step  # tokens a decode step yields (drafts accepted)
    decode_s = (1 - share) * decode.step_s / per_step  # seconds per token served, by phase
    prefill_s = share * prefill.step_s / (dp * prompt) if prefill is not None else 0.0
    rate = 1 / (decode_s + prefill_s) if batch else 0.0
    slow = prefill if prefill is not None and prefill_s > decode_s else decode
    sizes = need(max(1, math.ceil(batch / dp)))
    return Served(
        decode.candidate, batch, rate, rate / candidate.devices, decode, prefill, sizes, batch > 0,
        slow.bottleneck, decode.placement,
    )  # fmt: skip


def _activations(prefill: Estimate | None) -> int:
    return prefill.bytes["activations"] if prefill is not None else 0


def _admitted(need: Any, memory: float, cap: int | None, dp: int) -> int:
    """The most sequences per rank whose bytes (``need(n)["total"]``, growing with ``n``) fit ``memory``; 0 if one
    does not. Bytes grow linearly until a decode step's activations outgrow a prefill's, then faster: the slope at
    one sequence bounds the answer from above, and a bisection finds it exactly. Unbounded memory admits the cap
    (``cap`` sequences over ``dp`` ranks, as many as a finite budget past the cap's bytes would)."""
    if memory == math.inf:
        return -(-cap // dp)
    one = need(1)["total"]
    if one > memory:
        return 0
    slope = need(2)["total"] - one
    if slope <= 0:
        raise ValueError("serve_estimate: a sequence's bytes must grow with the sequences held")
    lo, hi = 1, int((memory - one) // slope) + 2  # need(lo) fits; need(hi) does not
    while need(hi)["total"] <= memory:  # rounding: the bound was short
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid)["total"] <= memory else (lo, mid)
    return lo
