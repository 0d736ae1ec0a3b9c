"""The step model: one candidate plan's modelled decode or prefill step and its bytes per rank.

:func:`estimate` checks the candidate with :func:`~functional_npu.placement.place` (a plan the model cannot run is
a ValueError with the reason) and models:

- **bytes per rank**, counted from the real layouts at every coordinate (the rank that holds the most): the
  weights in the workload's dtype (a quantized checkpoint's stored tensors as stored), the KV cache as the serving
  engine's paged pools hold the rank's sequences (:func:`~functional_npu.models.paged.cache_bytes`, the rule the
  engine's budget is spent by; the layers' shapes from the family's own ``init_kv`` on the meta device: blocks of
  the context per sequence, a sliding layer's ring of blocks, and the null blocks), the prefetch ring's
  ``k + 1`` slots of one layer, and the activations (an estimate: a few ``tokens x hidden`` buffers and the
  rank's logits);
- **step time**: the weights the step reads (every held weight once; of the experts, the share the step's
  tokens are expected to touch) and the KV cache at the device's memory bandwidth, or the step's FLOPs (counted
  from the logical weights, so a weight-only quantized model does the same matmuls as its float twin) at its
  peak, whichever is slower; plus each collective on the critical path as ``alpha + bytes / bandwidth``
  (:meth:`~functional_npu.parallel.devices.Device.collective_s`) on the links its group spans (a group whose
  ranks sit on two nodes runs on the inter-node link): tensor-parallel reductions, module TP's exchanges, expert
  dispatch and combine; plus the layer-shard broadcasts' exposed time from the prefetch cost model
  (:mod:`~functional_npu.parallel.prefetch_cost`), on the link the broadcast's group spans, and the copies of the
  series kept in host memory (``Plan.offload``) on the device's host link, under the same schedule;
- **host bytes**: the series kept in host memory are not the device's: they count as ``host``, beside the total;
- **the bottleneck**: weight reads, KV reads, compute or exposed communication.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ...core.mesh import Mesh
from ...core.numbers import is_int
from ...core.shard import local_shape
from ...models import family_of, paged
from ...parallel.devices import Device, Link, collective_factor
from ...parallel.devices import device as device_profile
from ...parallel.eplb_map import EXPERT_LEAVES
from ...parallel.module_tp import dp_axes
from ...parallel.plan import Plan
from ...parallel.prefetch_cost import choose_k, exposed, host_step
from ...placement.placement import Placement, place
from ...placement.quant_config import QuantConfig

__all__ = [
    "Workload",
    "Candidate",
    "Estimate",
    "Collective",
    "estimate",
    "cost_shape",
    "step_collectives",
    "step_transfers",
    "sequence_kv_bytes",
    "SCHEDULES",
    "check_positions",
    "check_request",
]


@dataclass(frozen=True)
class Workload:
    """What the plan is for. Fixed-batch workloads time one step: ``decode`` (one new token for each of ``batch``
    sequences holding ``context`` tokens) or ``prefill`` (``batch`` prompts of ``length`` tokens). A ``serve``
    workload is a server's steady state (:mod:`.serve`): sequences of ``context`` positions (prompt and generated
    tokens), ``prompt_share`` of the tokens processed being prompt tokens (0: decode alone), as many sequences at
    once as the memory left after the weights admits (at most ``max_seqs``; ``None``: no cap); it is ranked by
    tokens/s per device at that batch. Weights and cache in ``dtype``.

    The settings deployments use: ``weights="fp8"`` (8-bit float weights, on a device whose profile runs them,
    :attr:`~functional_npu.parallel.devices.Device.formats`), ``kv_dtype`` (the KV cache's own dtype, e.g.
    ``torch.float8_e4m3fn``), speculative decoding (``draft_tokens`` drafted per step and verified in one step,
    each accepted with probability ``acceptance``: a decode step computes ``1 + draft_tokens`` tokens per sequence
    and yields :attr:`tokens_per_step` of them), and ``admit="mean"`` (a serving workload's paged KV cache holds
    each sequence at its mean context, prompt plus half its generation, not its full context: the serving engine's
    blocks are taken as a sequence grows)."""

    kind: str
    batch: int = 1
    context: int = 0
    length: int = 0
    dtype: torch.dtype = torch.bfloat16
    prompt_share: float = 0.0
    max_seqs: int | None = None
    weights: str | None = None
    kv_dtype: torch.dtype | None = None
    draft_tokens: int = 0
    acceptance: float = 0.0
    admit: str = "full"

    def __post_init__(self) -> None:
        _check_settings(self)
        if self.kind not in ("decode", "prefill", "serve"):
            raise ValueError(f"workload: kind must be 'decode', 'prefill' or 'serve', got {self.kind!r}")
        _check_applies(self)
        if not is_int(self.batch, 1):
            raise ValueError(f"workload: batch must be a positive int, got {self.batch!r}")
        size = self.length if self.kind == "prefill" else self.context
        if not is_int(size, 1):
            what = "length (prompt tokens)" if self.kind == "prefill" else "context (tokens in each sequence's cache)"
            raise ValueError(f"workload: {self.kind} needs a positive {what}, got {size!r}")
        share = self.prompt_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
            raise ValueError(
                f"workload: prompt_share is the share of the tokens processed that are prompt tokens, a number in "
                f"[0, 1) (0: decode alone), got {share!r}"
            )
        if self.max_seqs is not None and not is_int(self.max_seqs, 1):
            raise ValueError(
                f"workload: max_seqs caps the sequences served at once: a positive int or None (no cap), got "
                f"{self.max_seqs!r}"
            )
        if self.kind == "serve" and round(share * self.context) >= self.context:
            raise ValueError(
                f"workload: a prompt share of {share} leaves no generated token in a context of {self.context}; "
                f"lower the share or lengthen the context"
            )
        if self.kind == "serve" and share and not round(share * self.context):
            raise ValueError(
                f"workload: a prompt share of {share} rounds to no prompt token in a context of {self.context}; give "
                f"at least {1 / self.context:.3g} (one token), or 0 for decode alone"
            )
        if self.kind == "serve" and self.context < 2:
            raise ValueError(
                f"workload: a served sequence of context {self.context} has no room for a prompt token and a "
                f"generated one; give a context of at least 2"
            )

    @staticmethod
    def decode(batch: int, context: int, dtype: torch.dtype = torch.bfloat16) -> Workload:
        return Workload("decode", batch, context=context, dtype=dtype)

    @staticmethod
    def prefill(length: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> Workload:
        return Workload("prefill", batch, length=length, dtype=dtype)

    @staticmethod
    def serve(
        context: int, prompt_share: float = 0.0, max_seqs: int | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> Workload:
        return Workload("serve", context=context, dtype=dtype, prompt_share=prompt_share, max_seqs=max_seqs)

    def with_(self, **settings: Any) -> Workload:
        """This workload with deployment settings (``weights``, ``kv_dtype``, ``draft_tokens``, ``acceptance``,
        ``admit``), checked."""
        return dataclasses.replace(self, **settings)

    @property
    def tokens_per_step(self) -> float:
        """Tokens a sequence's decode step yields: 1, or with ``draft_tokens`` drafted and each accepted with
        probability ``acceptance`` (a draft counts only after every earlier one is accepted), ``sum(a ** i for i in
        0..d)``."""
        return sum(self.acceptance**i for i in range(self.draft_tokens + 1))

    @property
    def weight_bytes(self) -> int:
        """Bytes per unquantized weight element: 1 for ``weights="fp8"``, else ``dtype``'s."""
        return 1 if self.weights == "fp8" else self.dtype.itemsize

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def prompt_len(self) -> int:
        """A served sequence's prompt tokens (its share of the context)."""
        return round(self.prompt_share * self.context)

    @property
    def cache_len(self) -> int:
        """Positions each sequence's cache holds after the step (a served sequence: its whole context)."""
        return {"decode": self.context + 1, "prefill": self.length, "serve": self.context}[self.kind]

    @property
    def new_tokens(self) -> int:
        """Tokens per sequence the step computes (a speculative decode step verifies its drafts with its token)."""
        return self.length if self.kind == "prefill" else 1 + self.draft_tokens

    def __str__(self) -> str:
        if self.kind == "decode":
            return f"decode, batch {self.batch}, context {self.context}"
        if self.kind == "serve":
            mix = f"{self.prompt_share:.0%} prompt tokens" if self.prompt_share else "decode alone"
            cap = f", at most {self.max_seqs} sequences" if self.max_seqs else ""
            return f"serving, context {self.context}, {mix}{cap}"
        return f"prefill of {self.length} tokens" + (f" x {self.batch}" if self.batch > 1 else "")


# the shape fields each kind reads (the others keep their defaults: a field set for another kind is a mistake)
_APPLIES = {
    "decode": ("batch", "context"),
    "prefill": ("batch", "length"),
    "serve": ("context", "prompt_share", "max_seqs"),
}
_SHAPE_DEFAULTS = {"batch": 1, "context": 0, "length": 0, "prompt_share": 0.0, "max_seqs": None}


def _check_applies(w: Workload) -> None:
    """One line naming a shape field set that ``w``'s kind does not read (it would be silently ignored)."""
    reads = _APPLIES[w.kind]
    for name, default in _SHAPE_DEFAULTS.items():
        value = getattr(w, name)
        if name not in reads and value != default:
            raise ValueError(
                f"workload: {name}={value!r} does not apply to a {w.kind} workload (it reads {', '.join(reads)}); "
                f"drop it, or build the workload with Workload.{w.kind}(...)"
            )


FORMATS = ("fp8",)  # weight formats a workload may name beyond its dtype (quantized ints: a QuantConfig)
ADMIT = ("full", "mean")


def _check_settings(w: Workload) -> None:
    """One line naming the field for a deployment setting the step model cannot price."""
    if not isinstance(w.dtype, torch.dtype) or not w.dtype.is_floating_point:
        raise ValueError(
            f"workload: dtype is the activations' and unquantized weights' torch dtype (torch.bfloat16, torch.float16, "
            f"torch.float32), got {w.dtype!r}; int8 or int4 weights are a QuantConfig (quant=...)"
        )
    if w.weights is not None and w.weights not in FORMATS:
        raise ValueError(
            f"workload: weights={w.weights!r} is not a format the planner prices; it prices {list(FORMATS)} (or "
            f"None: the dtype's; int8 / int4 weights: a QuantConfig)"
        )
    kv = w.kv_dtype
    if kv is not None and not (isinstance(kv, torch.dtype) and kv.is_floating_point and kv.itemsize in (1, 2, 4)):
        raise ValueError(
            f"workload: kv_dtype must be a torch dtype of 1, 2 or 4 bytes, a floating one (torch.bfloat16, "
            f"torch.float8_e4m3fn), got {kv!r}"
        )
    if isinstance(w.draft_tokens, bool) or not isinstance(w.draft_tokens, int) or not 0 <= w.draft_tokens <= 16:
        raise ValueError(
            f"workload: draft_tokens (speculative tokens drafted per step) must be an int in [0, 16], got "
            f"{w.draft_tokens!r}"
        )
    a = w.acceptance
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
        raise ValueError(f"workload: acceptance (a draft token's acceptance rate) must be in [0, 1], got {a!r}")
    if a and not w.draft_tokens:
        raise ValueError(f"workload: acceptance={a} without draft_tokens: name the tokens drafted per step")
    if w.draft_tokens and w.kind == "prefill":
        raise ValueError("workload: draft_tokens apply to decode and serving workloads, not a prefill")
    if w.admit not in ADMIT or (w.admit == "mean" and w.kind != "serve"):
        raise ValueError(
            f"workload: admit must be one of {ADMIT} ('mean' for a serving workload: its paged cache at each "
            f"sequence's mean context), got {w.admit!r} for a {w.kind} workload"
        )


def check_positions(cfg: Any, workload: Workload) -> None:
    """Refuse a workload whose sequences hold more positions than the model has (``max_position_embeddings``)."""
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit is not None and workload.cache_len > limit:
        field_name = "length" if workload.kind == "prefill" else "context"
        raise ValueError(
            f"workload: {workload.kind} {field_name} {workload.cache_len} positions is past the model's {limit} "
            f"(max_position_embeddings); give at most {limit - (workload.kind == 'decode')}"
        )


def check_formats(workload: Workload, dev: Device) -> None:
    """Refuse, in one line naming the field, a format the device's profile does not run."""
    wanted = {"weights": workload.weights}
    if workload.kv_dtype is not None and workload.kv_dtype.is_floating_point and workload.kv_dtype.itemsize == 1:
        wanted["kv_dtype"] = "fp8"
    for field_name, fmt in wanted.items():
        if fmt is not None and fmt not in dev.formats:
            raise ValueError(
                f"workload: {field_name} {fmt!r} is not a format {dev.name} runs (it runs {list(dev.formats)}); use "
                f"int8 weights (a QuantConfig) or a 16-bit cache there"
            )


SCHEDULES = ("serial", "two_batch")


@dataclass(frozen=True)
class Candidate:
    """A mesh (axis sizes) and a plan over it; ``name`` is how reports show it. ``schedule``: how a step runs:
    ``"serial"`` (as this library's runtime runs it: each collective waits for the compute before it) or
    ``"two_batch"`` (two-batch overlap: the step's sequences in two micro-batches, one's collectives beside the
    other's compute, as deployments run expert parallelism; priced, not yet run by this library)."""

    name: str
    axes: dict[str, int]
    plan: Plan
    schedule: str = "serial"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"candidate {self.name!r}: schedule must be one of {SCHEDULES}, got {self.schedule!r}")

    @property
    def devices(self) -> int:
        return math.prod(self.axes.values())

    @property
    def runs(self) -> bool:
        """Whether this library runs the candidate (a plan it does not run is priced and shown, never chosen)."""
        return self.schedule == "serial"


@dataclass(frozen=True)
class Estimate:
    """One candidate's modelled step and bytes on its busiest rank.

    Attributes:
        step_s: the modelled step time; ``parts``: its terms (``memory_s``, ``compute_s``, one per collective kind,
            ``prefetch_exposed_s``), ``step_s`` being ``max(memory_s, compute_s)`` plus the rest.
        bytes: ``weights``, ``kv_cache``, ``prefetch``, ``activations`` and ``total`` on the rank holding the most.
        fits: ``bytes["total"] <= memory``.
    """

    candidate: Candidate
    step_s: float
    parts: dict[str, float]
    bytes: dict[str, int]
    fits: bool
    placement: Placement = field(repr=False)  # the candidate checked on the model, its prefetch step chosen
    reads: dict[str, float] = field(default_factory=dict)  # bytes the step reads: "weights", "kv_cache"

    @property
    def runs(self) -> bool:
        return self.candidate.runs

    @property
    def bottleneck(self) -> str:
        """The term the step waits on most: ``weight reads``, ``KV reads``, ``compute``, ``exposed
        communication`` (the collectives and the broadcasts the prefetch does not hide) or ``fixed cost`` (the
        profile's per-step overhead)."""
        mem, comp = self.parts["memory_s"], self.parts["compute_s"]
        fixed = self.parts.get("fixed_s", 0.0)
        total = sum(self.reads.values()) or 1
        terms = {
            "weight reads": mem * self.reads.get("weights", 0) / total if mem >= comp else 0.0,
            "KV reads": mem * self.reads.get("kv_cache", 0) / total if mem >= comp else 0.0,
            "compute": comp if comp > mem else 0.0,
            "exposed communication": self.step_s - max(mem, comp) - fixed,
            "fixed cost": fixed,
        }
        return max(terms, key=lambda k: terms[k])

    def row(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "plan": self.candidate.name,
            "runs": self.runs,
            "axes": self.candidate.axes,
            "step_ms": self.step_s * 1e3,
            "parts_ms": {k: v * 1e3 for k, v in self.parts.items()},
            "bytes_per_rank": self.bytes,
            "bottleneck": self.bottleneck,
            "fits": self.fits,
        }


def cost_shape(cfg: Any) -> Any:
    family = family_of(cfg)
    if family.cost is None:
        raise ValueError(
            f"choose_plan: the {family.name} family ({cfg.architecture}) has no cost rules yet: it needs a "
            f"Family.cost giving the sizes the cost model reads (models.family.CostShape)"
        )
    return family.cost(cfg)


def estimate(
    cfg: Any,
    candidate: Candidate,
    device: Device | str,
    workload: Workload,
    *,
    memory_per_device: float = math.inf,
    quant: QuantConfig | None = None,
    dispatch: str = "runtime",
) -> Estimate:
    """The modelled step and bytes of ``candidate`` for a decode or prefill step (see the module docstring).
    ``dispatch``: how expert parallelism moves tokens: ``"runtime"``, as this library's runtime does
    (:mod:`functional_npu.models.experts`: every token to every expert rank, static capacity); ``"routed"``, as
    the deployments that dispatch each token only to the ranks of its chosen experts, in 8 bits, and combine in
    16 (DeepEP, vllm-ascend's fused MoE dispatch), for pricing what they publish.

    Raises:
        ValueError: the model cannot run the candidate (:func:`~functional_npu.placement.place`'s message), or
            ``workload`` is a serving one (:func:`~.serve.serve_estimate` ranks those).
    """
    check_request(candidate, workload, memory_per_device, quant, dispatch, "estimate")
    if workload.kind == "serve":
        raise ValueError("estimate times one decode or prefill step; serve_estimate sizes a serving workload's batch")
    if candidate.schedule == "two_batch":
        return _two_batch(cfg, candidate, device, workload, memory_per_device, quant, dispatch)
    dev, shape = device_profile(device), cost_shape(cfg)
    check_positions(cfg, workload)
    placed = place(cfg, candidate.axes, candidate.plan, quant, where=candidate.name)
    plan, mesh = placed.plan, Mesh.abstract(candidate.axes, 0)
    check_formats(workload, dev)
    e, ew = workload.dtype.itemsize, workload.weight_bytes  # activations' bytes, an unquantized weight's
    dp, tp = mesh.axis_size(dp_axes(mesh, plan.tp)), mesh.axis_size(plan.tp)
    seqs = math.ceil(workload.batch / dp)  # sequences on the busiest dp rank
    tokens = seqs * workload.new_tokens
    axes = tuple(candidate.axes.items())
    held = _held_at(cfg, axes, candidate.plan, quant, ew)
    # FLOPs count the logical weights: a quantized checkpoint multiplies as many weights as its float twin
    logical = held if quant is None else _held_at(cfg, axes, candidate.plan, None, ew)
    kv = workload.cache_dtype
    with torch.device("meta"):  # KV cache: the serving engine's pools, shaped by the family's own cache
        one = family_of(cfg).blocks(cfg, plan).init_kv(mesh, 1, workload.cache_len, kv)
    layout = paged.layout_of(one, workload.cache_len)
    kv_bytes = paged.cache_bytes(layout, seqs, workload.cache_len, kv, chunk=workload.new_tokens)
    reads, flops = _reads_and_flops(shape, plan, mesh, held, logical, tokens, workload, seqs)
    reads["kv_cache"] = kv_bytes if workload.kind == "decode" else 0
    memory_s, compute_s = sum(reads.values()) / dev.memory_bytes_per_s, flops / dev.flop_per_s
    parts: dict[str, float] = {"memory_s": memory_s, "compute_s": compute_s}
    for c in _collectives(shape, mesh, plan, tokens, seqs, e, dispatch):  # on the critical path
        nodes = _nodes(dev, mesh, c.axes)
        parts[c.kind] = parts.get(c.kind, 0.0) + c.count * dev.collective_s(c.kind, c.ranks, c.payload, nodes=nodes)
    ring = 0
    peer = plan.layer_shard is not None and mesh.axis_size(plan.layer_shard.axis) > 1
    if peer or plan.offload:
        busy = max(memory_s, compute_s)
        k = _prefetch_step(dev, mesh, plan, shape, held, busy)
        if peer:
            parts["prefetch_exposed_s"] = _exposed(dev, dev.link_for(_nodes(dev, mesh, plan.layer_shard.axis)),
                                                   shape, k, held.layer_series, busy)  # fmt: skip
        if plan.offload:
            parts["host_copy_exposed_s"] = _exposed(dev, _host_link(dev, candidate), shape, k, held.host_layer, busy)
        ring = (k + 1) * ((held.layer_series if peer else 0) + held.host_layer)
        candidate = dataclasses.replace(candidate, plan=dataclasses.replace(plan, prefetch_step=k))
        placed = placed.with_plan(candidate.plan, candidate.name)
    if dev.step_overhead_s:  # the profile's fixed cost per step (scheduling, launches, dispatch)
        parts["fixed_s"] = dev.step_overhead_s
    step = max(memory_s, compute_s) + sum(v for name, v in parts.items() if name not in ("memory_s", "compute_s"))
    vocab_local = shape.vocab / max(1, tp)  # the step's last tokens' logits, in float32
    activations = int(tokens * (8 * shape.hidden + 2 * shape.attn_width / tp) * e + seqs * vocab_local * 4)
    weights = held.weights - held.host  # the series kept in host memory are not the device's
    total = weights + kv_bytes + ring + activations
    sizes = {"weights": weights, "kv_cache": kv_bytes, "prefetch": ring, "activations": activations}
    sizes["total"], sizes["host"] = total, held.host
    return Estimate(candidate, step, parts, sizes, total <= memory_per_device, placed, reads)


def check_request(
    candidate: Any, workload: Any, memory: Any, quant: Any, dispatch: Any, where: str, *, candidates: bool = True
) -> None:
    """One line naming the first argument no candidate can be priced with (checked once, before any is priced):
    the candidate's and workload's types, the memory budget (NaN and negatives refused; ``math.inf``: unbounded),
    the quantization's type, the dispatch."""
    if candidates and not isinstance(candidate, Candidate):
        raise TypeError(
            f"{where}: candidate must be a Candidate (planning.candidates(cfg, devices) lists them), got {candidate!r}"
        )
    if not isinstance(workload, Workload):
        raise TypeError(f"{where}: workload must be a Workload (decode, prefill or serve), got {workload!r}")
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not memory > 0:  # NaN > 0 is False
        raise ValueError(
            f"{where}: memory_per_device must be a positive number of bytes (math.inf: unbounded), got {memory!r}"
        )
    if quant is not None and not isinstance(quant, QuantConfig):
        raise TypeError(f"{where}: quant must be a QuantConfig (e.g. QuantConfig.of(Quant(8))) or None, got {quant!r}")
    if dispatch not in DISPATCH:
        raise ValueError(f"{where}: dispatch must be one of {DISPATCH}, got {dispatch!r}")


def sequence_kv_bytes(cfg: Any, candidate: Candidate, positions: int, dtype: torch.dtype) -> int:
    """Bytes one sequence's KV cache of ``positions`` positions takes on one rank under ``candidate``, in the
    serving engine's paged blocks (the pools' null blocks not counted): what a disaggregated deployment moves per
    prompt to each decode rank."""
    placed = place(cfg, candidate.axes, candidate.plan, where=candidate.name)
    mesh = Mesh.abstract(candidate.axes, 0)
    with torch.device("meta"):
        one = family_of(cfg).blocks(cfg, placed.plan).init_kv(mesh, 1, positions, dtype)
    layout = paged.layout_of(one, positions)
    return paged.cache_bytes(layout, 1, positions, dtype, chunk=positions) - paged.cache_bytes(
        layout, 0, positions, dtype, chunk=positions
    )


def _two_batch(
    cfg: Any,
    candidate: Candidate,
    device: Device | str,
    workload: Workload,
    memory: float,
    quant: QuantConfig | None,
    dispatch: str,
) -> Estimate:
    """The step under two-batch overlap: each rank's sequences (a single prompt: its tokens) in two halves, each
    half a serial step of its own (every weight read again, its own collectives); one half's collectives run beside
    the other's reads and compute, so the step takes the larger of the two halves' busy time and their
    communication, plus the one layer's share the pipeline cannot hide at its ends. A rank with one sequence to
    decode runs it as one batch (nothing to overlap). The bytes are the whole batch's."""
    serial = dataclasses.replace(candidate, schedule="serial")
    whole = estimate(cfg, serial, device, workload, memory_per_device=memory, quant=quant, dispatch=dispatch)
    plan, mesh = whole.placement.plan, Mesh.abstract(candidate.axes, 0)
    dp = mesh.axis_size(dp_axes(mesh, plan.tp))
    seqs = math.ceil(workload.batch / dp)
    if seqs >= 2:
        half = dataclasses.replace(workload, batch=math.ceil(seqs / 2) * dp)
    elif workload.kind == "prefill" and workload.length >= 2:
        half = dataclasses.replace(workload, length=math.ceil(workload.length / 2))
    else:
        return dataclasses.replace(whole, candidate=candidate)
    h = estimate(cfg, serial, device, half, quant=quant, dispatch=dispatch)
    busy = max(h.parts["memory_s"], h.parts["compute_s"])
    fixed = h.parts.get("fixed_s", 0.0)
    ring = sum(h.parts.get(k, 0.0) for k in _RING_PARTS)
    comm = h.step_s - busy - fixed - ring  # the half's collectives
    layers = cost_shape(cfg).layers
    step = max(2 * busy, 2 * comm) + min(busy, comm) / layers + 2 * ring + fixed
    parts = {"memory_s": 2 * h.parts["memory_s"], "compute_s": 2 * h.parts["compute_s"]}
    parts["overlapped_communication_s"] = max(0.0, 2 * comm - 2 * busy) + min(busy, comm) / layers
    parts.update({k: 2 * h.parts[k] for k in _RING_PARTS if k in h.parts})
    if fixed:
        parts["fixed_s"] = fixed
    reads = {k: 2 * v for k, v in h.reads.items()}
    return dataclasses.replace(whole, candidate=candidate, step_s=step, parts=parts, reads=reads)


_RING_PARTS = ("prefetch_exposed_s", "host_copy_exposed_s")


def _reads_and_flops(
    shape: Any, plan: Plan, mesh: Mesh, held: _Held, logical: _Held, tokens: int, workload: Workload, seqs: int
) -> tuple[dict[str, float], float]:
    """The weight bytes a step reads (every held weight but the experts once, every layer's series, its own and
    the ones broadcast to it; of the experts, the share its tokens touch under uniform routing over the expert
    group's tokens) and its FLOPs (from the logical weights, at 2 per weight per token, the head's per sequence: a
    prefill computes the logits of each sequence's last token alone; plus attention's)."""
    e = workload.weight_bytes  # logical weights were counted at this many bytes each
    ep = mesh.axis_size(plan.expert_axes) if plan.expert_axes else 1
    # the expert group's tokens, each routed once: its ranks' tokens, at most the group's share of the batch's (a
    # batch smaller than the data-parallel ranks leaves ranks with none: 8 sequences over 32 route 8 tokens, not 32)
    tp_in_group = mesh.axis_size(plan.tp) if plan.tp in tuple(plan.expert_axes) else 1
    dp = mesh.axis_size(dp_axes(mesh, plan.tp))
    group_share = min(1.0, ep / tp_in_group / dp)
    routed_tokens = min(ep * _routed_here(mesh, plan, tokens), workload.batch * workload.new_tokens * group_share)
    touched = 1 - (1 - shape.top_k / shape.experts) ** routed_tokens if shape.experts else 1.0
    dense = held.weights - held.experts - held.series + held.layer_series * shape.layers  # host series read in slots
    reads = {"weights": dense + touched * held.experts}
    logical_dense = logical.weights - logical.experts - logical.series + logical.layer_series * shape.layers
    flops = 2 * (tokens * (logical_dense - logical.head) + seqs * logical.head) / e
    if shape.experts:  # each routed (token, expert) pair multiplies one expert's held share
        flops += 2 * routed_tokens * shape.top_k / shape.experts * logical.experts / e
    ctx = workload.context if workload.kind == "decode" else workload.length / 2
    flops += 4 * tokens * ctx * shape.attn_width / mesh.axis_size(plan.tp) * shape.layers  # scores and values
    return reads, flops


def _host_link(dev: Device, candidate: Candidate) -> Link:
    """The device's host link, or a ValueError naming why offloading is not priced there."""
    if dev.host_link is None:
        raise ValueError(
            f"{candidate.name}: {dev.name} has no host link in its profile (its memory is the host's): keeping "
            f"series in host memory frees nothing there"
        )
    return dev.host_link


def _prefetch_step(dev: Device, mesh: Mesh, plan: Plan, shape: Any, held: _Held, compute_s: float) -> int:
    """The ring's one prefetch step: the plan's, else the largest the cost model picks for either source (the
    layer-shard broadcasts on the link the axis' groups span, an owner's broadcast crossing nodes if its group does;
    the host copies on the host link)."""
    if isinstance(plan.prefetch_step, int) and plan.prefetch_step:
        return plan.prefetch_step
    if not dev.overlap:  # where transfers take turns with compute, fetching ahead hides nothing: one slot is enough
        return 0
    per_layer, steps = compute_s / shape.layers, [0]
    if plan.layer_shard is not None and mesh.axis_size(plan.layer_shard.axis) > 1:
        link = dev.link_for(_nodes(dev, mesh, plan.layer_shard.axis))
        steps.append(choose_k(held.layer_series, num_layers=shape.layers, compute_s=per_layer, link=link))
    if plan.offload and dev.host_link is not None:
        steps.append(host_step(held.host_layer, num_layers=shape.layers, compute_s=per_layer, link=dev.host_link))
    return max(steps)


def _exposed(dev: Device, link: Link, shape: Any, k: int, layer_bytes: int, compute_s: float) -> float:
    """Seconds per step one source's transfers of ``layer_bytes`` per layer leave exposed at prefetch step ``k``."""
    per_layer = compute_s / shape.layers
    occupy, latency = layer_bytes / link.bytes_per_s, link.time(layer_bytes)
    hidden = exposed(shape.layers, k, per_layer, occupy, latency) if dev.overlap else 1.0
    return hidden * shape.layers * latency


class _Held(NamedTuple):
    """Weight bytes on the rank holding the most: all, the layer-sharded series, one layer of it, the experts, the
    series kept in host memory and one layer of them, the head's (``lm_head``; a tied head's, the embedding's)."""

    weights: int
    series: int
    layer_series: int
    experts: int
    host: int = 0
    host_layer: int = 0
    head: int = 0


@functools.lru_cache(maxsize=256)
def _held_at(cfg: Any, axes: tuple[tuple[str, int], ...], plan: Plan, quant: QuantConfig | None, e: int) -> _Held:
    """:func:`_held` of the candidate's placement, counted once per candidate and dtype (a serving workload's
    batch search prices one candidate at many batches; the weights do not change with the batch)."""
    return _held(place(cfg, dict(axes), plan, quant), Mesh.abstract(dict(axes), 0), e)


def _held(placed: Placement, mesh: Mesh, e: int) -> _Held:
    """On the rank holding the most weight bytes (floats at ``e`` bytes): ``(weights, layer-sharded series, one
    layer of the series, experts)`` in bytes, counted from every leaf's layout at every coordinate."""
    held, series_held, series_layer, expert_held, host_held, host_layer, head = ([0] * mesh.size for _ in range(7))
    untied = any(path.split(".")[0] == "lm_head" for path in placed.meta_leaves)
    head_leaf = "lm_head" if untied else "embed"  # a tied head multiplies the embedding
    coords = [mesh.at(r) for r in range(mesh.size)]
    shapes: dict[tuple, tuple[int, ...]] = {}  # layers repeat their leaves' shapes and layouts: cut each once
    for path, m in placed.meta_leaves.items():
        size = e if m.dtype.is_floating_point else m.element_size()
        parts_of, layout = path.split("."), placed.layouts[path]
        for r in range(mesh.size):
            key = (tuple(m.shape), layout, r)
            if key not in shapes:
                shapes[key] = tuple(local_shape(m.shape, layout, coords[r], path=path))
            local = shapes[key]
            n = math.prod(local) * size
            held[r] += n
            if parts_of[0] == "series":  # stacked [owned layers, ...]: one layer is the rest
                series_held[r] += n
                series_layer[r] += math.prod(local[1:]) * size
            if parts_of[0] == "host":  # stacked [L, ...] in host memory: one layer is the rest
                host_held[r] += n
                host_layer[r] += math.prod(local[1:]) * size
            if any(x in EXPERT_LEAVES for x in parts_of):
                expert_held[r] += n
            if parts_of[0] == head_leaf:
                head[r] += n
    busiest = max(range(mesh.size), key=lambda r: (held[r] - host_held[r], r))
    return _Held(
        held[busiest],
        series_held[busiest],
        series_layer[busiest],
        expert_held[busiest],
        host_held[busiest],
        host_layer[busiest],
        head[busiest],
    )


DISPATCH = ("runtime", "routed")


class Collective(NamedTuple):
    """One kind of collective a step runs: ``count`` calls over groups along ``axes`` (``ranks`` each), each of
    ``payload`` bytes (an all-gather's output, the input of the others), as the runtime issues it."""

    kind: str
    axes: Any
    ranks: int
    payload: float
    count: int

    @property
    def received(self) -> float:
        """Bytes each rank receives over the ``count`` calls: from the others, in the bandwidth-optimal collective
        (:func:`~functional_npu.parallel.devices.collective_factor`); a ring's broadcasts, on average over the
        group's ranks (each the source of its own layers, a ``1 / ranks`` share); a host copy, all of it."""
        if self.kind == "broadcast":
            return self.count * (self.ranks - 1) / self.ranks * self.payload
        if self.kind == "host_copy":
            return self.count * self.payload
        return self.count * collective_factor(self.kind, self.ranks) * self.payload


def step_collectives(cfg: Any, candidate: Candidate, workload: Workload, dtype: torch.dtype | None = None) -> list:
    """The :class:`Collective` list of one decode or prefill step of ``workload`` under ``candidate``: what the step
    model prices, call by call kind (the tests count the same on gloo ranks, at the collectives)."""
    placed = place(cfg, candidate.axes, candidate.plan, where=candidate.name)
    plan, mesh = placed.plan, Mesh.abstract(candidate.axes, 0)
    seqs = math.ceil(workload.batch / mesh.axis_size(dp_axes(mesh, plan.tp)))
    e = (dtype or workload.dtype).itemsize
    return _collectives(cost_shape(cfg), mesh, plan, seqs * workload.new_tokens, seqs, e)


def step_transfers(cfg: Any, candidate: Candidate, workload: Workload, dtype: torch.dtype | None = None) -> list:
    """The prefetch ring's transfers per step under ``candidate`` (what :func:`estimate` prices as
    ``prefetch_exposed_s`` and ``host_copy_exposed_s``): a ``"broadcast"`` :class:`Collective` per layer of the
    layer-sharded series over its axis, a ``"host_copy"`` per layer of the series kept in host memory, each of one
    layer's bytes on the busiest rank."""
    placed = place(cfg, candidate.axes, candidate.plan, where=candidate.name)
    plan, mesh = placed.plan, Mesh.abstract(candidate.axes, 0)
    held = _held_at(cfg, tuple(candidate.axes.items()), candidate.plan, None, (dtype or workload.dtype).itemsize)
    layers, out = cost_shape(cfg).layers, []
    if plan.layer_shard is not None and mesh.axis_size(plan.layer_shard.axis) > 1:
        n = mesh.axis_size(plan.layer_shard.axis)
        out.append(Collective("broadcast", plan.layer_shard.axis, n, held.layer_series, layers))
    if plan.offload:
        out.append(Collective("host_copy", None, 1, held.host_layer, layers))
    return out


def _collectives(
    shape: Any, mesh: Mesh, plan: Plan, tokens: int, seqs: int, e: int, dispatch: str = "runtime"
) -> list[Collective]:
    """The collectives a step waits on, as the runtime issues them (:mod:`functional_npu.models.experts`,
    :mod:`functional_npu.parallel.module_tp`): ``tokens`` on the busiest dp rank, ``seqs`` sequences; the head's at
    one position per sequence (a prefill takes each sequence's last token before the head)."""
    d, layers = shape.hidden, shape.layers
    tp = mesh.axis_size(plan.tp)
    moe = len(shape.moe_layers)
    dense = layers - moe
    out: list[Collective] = []

    def add(kind: str, axes: Any, payload: float, count: int) -> None:
        n = mesh.axis_size(axes) if axes else 1
        if n > 1 and count > 0:
            out.append(Collective(kind, axes, n, payload, count))

    ep_axes = tuple(plan.expert_axes)
    ep = mesh.axis_size(ep_axes) if ep_axes else 1
    split = ep > 1 and plan.tp in ep_axes and tp > 1  # each tp rank routes its own 1 / tp of the tokens
    expert_tp = plan.tp not in ep_axes  # each expert's down projection row-parallel over tp: an all-reduce
    # the embedding's vocab-parallel sum, attention's o_proj, the dense MLPs, experts whose down is over tp
    add("all_reduce", plan.tp, tokens * d * e, 1 + layers + dense + (moe if expert_tp else 0))
    add("all_reduce", plan.tp, tokens * d * e, moe if shape.shared_experts else 0)  # the shared experts' MLP
    add("all_gather", plan.tp, seqs * shape.vocab * e, 1)  # the logits: one position per sequence (a prefill's last)
    if ep > 1 and moe:
        local = _routed_here(mesh, plan, tokens)
        if dispatch == "routed":  # each token to its chosen experts' ranks only: 8-bit out, 16-bit back
            add("all_to_all", ep_axes, local * min(shape.top_k, ep) * d, moe)
            add("all_to_all", ep_axes, local * min(shape.top_k, ep) * d * 2, moe)
        elif local <= plan.dispatch_threshold:  # gathered, each rank its slots' share, reduce-scattered back
            add("all_gather", ep_axes, ep * local * d * e, moe)
            add("reduce_scatter", ep_axes, ep * local * d * e, moe)
        else:  # every token to every expert rank (static capacity), its routing beside it, the outputs back
            add("all_to_all", ep_axes, ep * local * d * e, 2 * moe)
            add("all_to_all", ep_axes, ep * local * 2 * shape.top_k * 4, moe)
        if split:
            add("all_gather", plan.tp, tp * local * d * e, moe)
    for module, axes in plan.module_tp.items():
        n = mesh.axis_size(axes) if axes else 1
        group = n * tokens
        if module == "o_proj":  # this rank's tokens' heads out, the group's tokens' share of heads back
            add("all_to_all", axes, tokens * shape.attn_width / tp * e, layers)
            add("reduce_scatter", axes, group * d * e, layers)
        elif module == "mlp":
            add("all_gather", axes, group * d * e, dense)
            add("reduce_scatter", axes, group * d * e, dense)
        elif module == "lm_head":  # the group's last hidden states gathered, each rank's logits back by vocab share
            add("all_gather", axes, n * seqs * d * e, 1)
            add("all_to_all", axes, seqs * shape.vocab / tp * e, 1)
        elif module == "embed":
            add("all_gather", axes, group * 8, 1)
            add("reduce_scatter", axes, group * d * e, 1)
    return out


def _routed_here(mesh: Mesh, plan: Plan, tokens: int) -> int:
    """The tokens one rank routes to the experts: its 1 / tp of them when the expert axes include tp (the tp ranks
    hold the same tokens, :func:`functional_npu.models.experts.moe_ffn`), else all of them."""
    tp = mesh.axis_size(plan.tp)
    return -(-tokens // tp) if plan.tp in tuple(plan.expert_axes) and tp > 1 else tokens


def _nodes(dev: Device, mesh: Mesh, axes: Any) -> int:
    """The most nodes any group along ``axes`` spans (ranks filled node by node in the mesh's row-major order)."""
    if dev.node_size is None or mesh.axis_size(axes) <= 1:
        return 1
    return max(dev.nodes_spanned(g) for g in mesh.all_group_ranks(axes))
