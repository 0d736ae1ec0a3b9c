"""Choose the plan: every candidate plan of a model on ``n`` devices, its modelled step time and bytes per rank.

:func:`choose_plan` answers "this model, these devices, this much memory each, this workload: which plan is
fastest, and does it fit?". It enumerates the candidates (:func:`candidates`: every ``dp x tp`` split, expert
parallelism for a model with experts, each module's TP over the dp ranks, layer-sharded series with the
prefetch step the cost model picks), checks each with :func:`~functional_npu.placement.place` (a plan
the model cannot run is reported with the reason, never ranked), and estimates each (:func:`estimate`):

- **bytes per rank**, counted from the real layouts at every coordinate (the rank that holds the most): the
  weights in the workload's dtype (a quantized checkpoint's stored tensors as stored), the KV cache the
  family's own ``init_kv`` allocates for the rank's sequences (on the meta device), the prefetch ring's
  ``k + 1`` slots of one layer, and the activations (an estimate: a few ``tokens x hidden`` buffers and the
  rank's logits);
- **step time**: the weights the step reads (every held weight once; of the experts, the share the step's
  tokens are expected to touch) and the KV cache at the device's memory bandwidth, or the step's FLOPs at its
  peak, whichever is slower; plus each collective on the critical path as ``alpha + bytes / bandwidth``
  (:meth:`~functional_npu.parallel.devices.Device.collective_s`): tensor-parallel reductions, module TP's
  exchanges, expert dispatch and combine; plus the layer-shard broadcasts' exposed time from the prefetch
  cost model (:mod:`~functional_npu.parallel.prefetch_cost`).

The winner is the fastest candidate that fits; the report says why (the runner-up's step time, and what the
faster plans lacked in memory). Nothing here reads a checkpoint or starts a process.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.mesh import Mesh
from ...core.shard import local_shape
from ...models import family_of
from ...parallel.devices import Device
from ...parallel.devices import device as device_profile
from ...parallel.eplb_map import EXPERT_LEAVES
from ...parallel.layer_shard import layer_shard
from ...parallel.module_tp import MODULES, dp_axes, split_dp
from ...parallel.plan import Plan
from ...parallel.prefetch_cost import choose_k, exposed
from ...placement.placement import Placement, place
from ...placement.quant_config import QuantConfig

# the most devices a plan is made for (every candidate's bytes are counted at every rank)
MAX_DEVICES = 1024

__all__ = ["Workload", "Candidate", "Estimate", "Report", "candidates", "estimate", "choose_plan", "PlanDoesNotFit"]

SERIES_CHOICES = ("o_proj", "o_proj,down_proj", "layer")  # the layer-sharded series a candidate may use


class PlanDoesNotFit(ValueError):
    """No candidate fits the memory budget; the message names the smallest memory that would and its plan."""


@dataclass(frozen=True)
class Workload:
    """What one step does: ``decode`` (one new token for each of ``batch`` sequences holding ``context``
    tokens) or ``prefill`` (``batch`` prompts of ``length`` tokens), with weights and cache in ``dtype``."""

    kind: str
    batch: int = 1
    context: int = 0
    length: int = 0
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        def positive(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        if self.kind not in ("decode", "prefill"):
            raise ValueError(f"workload: kind must be 'decode' or 'prefill', got {self.kind!r}")
        if not positive(self.batch):
            raise ValueError(f"workload: batch must be a positive int, got {self.batch!r}")
        size = self.context if self.kind == "decode" else self.length
        if not positive(size):
            what = "context (tokens in each sequence's cache)" if self.kind == "decode" else "length (prompt tokens)"
            raise ValueError(f"workload: {self.kind} needs a positive {what}, got {size!r}")

    @staticmethod
    def decode(batch: int, context: int, dtype: torch.dtype = torch.bfloat16) -> Workload:
        return Workload("decode", batch, context=context, dtype=dtype)

    @staticmethod
    def prefill(length: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> Workload:
        return Workload("prefill", batch, length=length, dtype=dtype)

    @property
    def cache_len(self) -> int:
        """Positions each sequence's cache holds after the step."""
        return self.context + 1 if self.kind == "decode" else self.length

    @property
    def new_tokens(self) -> int:
        """Tokens per sequence the step computes."""
        return 1 if self.kind == "decode" else self.length

    def __str__(self) -> str:
        if self.kind == "decode":
            return f"decode, batch {self.batch}, context {self.context}"
        return f"prefill of {self.length} tokens" + (f" x {self.batch}" if self.batch > 1 else "")


@dataclass(frozen=True)
class Candidate:
    """A mesh (axis sizes) and a plan over it; ``name`` is how reports show it."""

    name: str
    axes: dict[str, int]
    plan: Plan

    @property
    def devices(self) -> int:
        return math.prod(self.axes.values())


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

    def row(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "plan": self.candidate.name,
            "axes": self.candidate.axes,
            "step_ms": self.step_s * 1e3,
            "parts_ms": {k: v * 1e3 for k, v in self.parts.items()},
            "bytes_per_rank": self.bytes,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class Report:
    """Every candidate considered, ranked (fitting ones first, fastest first), the chosen one and why."""

    model: str
    device: Device
    devices: int
    memory_per_device: float
    workload: Workload
    ranked: list[Estimate]
    refused: list[tuple[str, str]] = field(default_factory=list)  # (candidate, why the model cannot run it)

    @property
    def chosen(self) -> Estimate:
        return self.ranked[0]

    def why(self) -> str:
        """One paragraph: the winner's step and bytes, the runner-up, and the faster plans that did not fit."""
        best = self.chosen
        out = (
            f"{best.candidate.name}: {best.step_s * 1e3:.3g} ms per step, {_gb(best.bytes['total'])} per rank "
            f"of {_gb(self.memory_per_device)}"
        )
        fitting = [e for e in self.ranked if e.fits]
        if len(fitting) > 1:
            second = fitting[1]
            out += f"; the next fastest that fits, {second.candidate.name}, takes {second.step_s * 1e3:.3g} ms"
        faster = [e for e in self.ranked if not e.fits and e.step_s < best.step_s]
        if faster:
            f = min(faster, key=lambda e: e.step_s)
            out += (
                f"; {len(faster)} faster plan(s) do not fit, the fastest {f.candidate.name} "
                f"({f.step_s * 1e3:.3g} ms) needs {_gb(f.bytes['total'])}"
            )
        return out

    def table(self) -> str:
        """The ranked table (plan, step time, bytes per rank, fits), as Markdown."""
        lines = [
            f"{self.model} on {self.devices} x {self.device.name} ({_gb(self.memory_per_device)} each), "
            f"{self.workload}",
            "",
            "| rank | plan | step ms | weights | KV cache | prefetch | activations | total / rank | fits |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for i, e in enumerate(self.ranked, 1):
            b = e.bytes
            lines.append(
                f"| {i} | {e.candidate.name} | {e.step_s * 1e3:.3g} | {_gb(b['weights'])} | {_gb(b['kv_cache'])} "
                f"| {_gb(b['prefetch'])} | {_gb(b['activations'])} | {_gb(b['total'])} "
                f"| {'yes' if e.fits else 'no'} |"
            )
        if self.refused:
            lines += ["", f"{len(self.refused)} candidate(s) the model cannot run:"]
            lines += [f"- {name}: {why}" for name, why in self.refused]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device.name,
            "devices": self.devices,
            "memory_per_device": self.memory_per_device,
            "workload": str(self.workload),
            "chosen": json.loads(self.chosen.placement.to_json()),
            "why": self.why(),
            "candidates": [e.row() for e in self.ranked],
            "refused": [{"plan": n, "why": w} for n, w in self.refused],
        }


def _gb(n: float) -> str:
    """Bytes in decimal units (GB = 1e9 bytes, as device memory is stated)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: Any, devices: int) -> list[Candidate]:
    """Every plan the planner weighs for ``cfg`` on ``devices`` ranks (not yet checked against the model):
    for each ``tp`` dividing ``devices`` (``dp = devices / tp``): the plain plan; expert parallelism over all
    ranks (a model with experts); each module's TP over all dp ranks, and all of them at once; each layer-sharded
    series of :data:`SERIES_CHOICES` over dp (prefetch step chosen when estimated)."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"choose_plan: devices must be a positive int, got {devices!r}")
    if devices > MAX_DEVICES:
        raise ValueError(
            f"choose_plan: {devices} devices is more than the planner weighs ({MAX_DEVICES}): it counts every "
            f"candidate's bytes at every rank, so its work grows with the devices; plan one node's or one replica's "
            f"devices (at most {MAX_DEVICES}) and repeat that plan over the rest with data parallelism"
        )
    experts = getattr(_shape(cfg), "experts", 0)
    out: list[Candidate] = []
    for tp in _divisors(devices):
        dp = devices // tp
        axes = {"dp": dp, "tp": tp}
        base = f"dp {dp} x tp {tp}"
        out.append(Candidate(base, axes, Plan()))
        if experts and devices > 1:
            out.append(Candidate(f"{base}, EP {devices}", axes, Plan(expert_axes=("dp", "tp"))))
        if dp > 1:
            for modules in [(m,) for m in MODULES] + [MODULES]:
                split, mtp = split_dp(axes, {m: dp for m in modules})
                label = "all modules" if modules == MODULES else modules[0]
                out.append(Candidate(f"{base}, {label} TP {dp}", split, Plan(module_tp=mtp)))
            for series in SERIES_CHOICES:
                ls = layer_shard(series, "dp")
                out.append(Candidate(f"{base}, {series} layer-sharded over dp", axes, Plan(layer_shard=ls)))
    return out


def _shape(cfg: Any) -> Any:
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
) -> Estimate:
    """The modelled step and bytes of ``candidate`` (see the module docstring).

    Raises:
        ValueError: the model cannot run the candidate (:func:`~functional_npu.placement.place`'s message).
    """
    dev, shape = device_profile(device), _shape(cfg)
    placed = place(cfg, candidate.axes, candidate.plan, quant, where=candidate.name)
    plan, mesh = placed.plan, Mesh.abstract(candidate.axes, 0)
    e = workload.dtype.itemsize
    data = dp_axes(mesh, plan.tp)
    dp, tp = mesh.axis_size(data), mesh.axis_size(plan.tp)
    seqs = math.ceil(workload.batch / dp)  # sequences on the busiest dp rank
    tokens = seqs * workload.new_tokens
    ls = plan.layer_shard
    weights, series, layer_series, experts = _held(placed, mesh, e)

    # KV cache: the family's own allocation for this rank's sequences, on the meta device
    with torch.device("meta"):
        kv = family_of(cfg).blocks(cfg, plan).init_kv(mesh, seqs, workload.cache_len, workload.dtype)
    kv_bytes = sum(t.numel() * t.element_size() for layer in kv for t in layer)

    # what the step reads: every held weight but the experts once, the experts its tokens touch (uniform
    # routing over the expert group's tokens), every layer's series (its own and the ones broadcast to it)
    ep = mesh.axis_size(plan.expert_axes) if plan.expert_axes else 1
    routed_tokens = tokens * ep
    touched = 1 - (1 - shape.top_k / shape.experts) ** routed_tokens if shape.experts else 1.0
    dense = weights - experts - series + layer_series * shape.layers
    read = dense + touched * experts + (kv_bytes if workload.kind == "decode" else 0)
    flops = 2 * tokens * dense / e
    if shape.experts:  # each routed (token, expert) pair multiplies one expert's held share
        flops += 2 * routed_tokens * shape.top_k / shape.experts * experts / e
    ctx = workload.context if workload.kind == "decode" else workload.length / 2
    flops += 4 * tokens * ctx * shape.attn_width / tp * shape.layers  # scores and values
    memory_s = read / dev.memory_bytes_per_s
    compute_s = flops / dev.flop_per_s
    parts: dict[str, float] = {"memory_s": memory_s, "compute_s": compute_s}

    # collectives on the critical path
    comm = _collectives(shape, mesh, plan, tokens, seqs, e)
    for kind, n, payload, count in comm:
        parts[kind] = parts.get(kind, 0.0) + count * dev.collective_s(kind, n, payload)

    # layer-shard broadcasts: their exposed time under the prefetch schedule
    ring, k = 0, 0
    if ls is not None and mesh.axis_size(ls.axis) > 1:
        per_layer = max(memory_s, compute_s) / shape.layers
        k = plan.prefetch_step if isinstance(plan.prefetch_step, int) and plan.prefetch_step else None
        if k is None:
            k = choose_k(layer_series, num_layers=shape.layers, compute_s=per_layer, link=dev.link)
        occupy = layer_series / dev.link.bytes_per_s
        latency = dev.link.time(layer_series)
        hidden = exposed(shape.layers, k, per_layer, occupy, latency) if dev.overlap else 1.0
        parts["prefetch_exposed_s"] = hidden * shape.layers * latency
        ring = (k + 1) * layer_series
        candidate = dataclasses.replace(candidate, plan=dataclasses.replace(plan, prefetch_step=k))
        placed = placed.with_plan(candidate.plan, candidate.name)
    step = max(memory_s, compute_s) + sum(v for name, v in parts.items() if name not in ("memory_s", "compute_s"))

    logits_rows = seqs  # the step's last tokens
    vocab_local = shape.vocab / max(1, tp)
    activations = int(tokens * (8 * shape.hidden + 2 * shape.attn_width / tp) * e + logits_rows * vocab_local * 4)
    total = weights + kv_bytes + ring + activations
    sizes = {"weights": weights, "kv_cache": kv_bytes, "prefetch": ring, "activations": activations, "total": total}
    return Estimate(candidate, step, parts, sizes, total <= memory_per_device, placed)


def _held(placed: Placement, mesh: Mesh, e: int) -> tuple[int, int, int, int]:
    """On the rank holding the most weight bytes (floats at ``e`` bytes): ``(weights, layer-sharded series, one
    layer of the series, experts)`` in bytes, counted from every leaf's layout at every coordinate."""
    held, series_held, series_layer, expert_held = ([0] * mesh.size for _ in range(4))
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
            if any(x in EXPERT_LEAVES for x in parts_of):
                expert_held[r] += n
    busiest = max(range(mesh.size), key=lambda r: (held[r], r))
    return held[busiest], series_held[busiest], series_layer[busiest], expert_held[busiest]


def _collectives(shape: Any, mesh: Mesh, plan: Plan, tokens: int, seqs: int, e: int) -> list[tuple]:
    """``(kind, group size, payload bytes, count per step)`` for the collectives a step waits on."""
    d, layers = shape.hidden, shape.layers
    tp = mesh.axis_size(plan.tp)
    moe = set(shape.moe_layers)
    out: list[tuple] = []
    ep = mesh.axis_size(plan.expert_axes) if plan.expert_axes else 1
    mtp = plan.module_tp
    if tp > 1:  # vocab-parallel embedding, attention and FFN reductions, the head's logits
        out.append(("all_reduce", tp, tokens * d * e, 1 + layers + (layers - len(moe) if ep > 1 else layers)))
        out.append(("all_gather", tp, seqs * shape.vocab * 4, 1))
    if ep > 1 and moe:  # dispatch and combine
        out.append(("all_to_all", ep, tokens * shape.top_k * d * e, 2 * len(moe)))
    for module, axes in mtp.items():
        n = mesh.axis_size(axes) if axes else 1
        if n <= 1:
            continue
        group = n * tokens
        if module == "o_proj":
            out.append(("all_to_all", n, group * shape.attn_width / tp * e, layers))
            out.append(("reduce_scatter", n, group * d * e, layers))
        elif module == "mlp":
            dense = layers - len(moe)
            out.append(("all_gather", n, group * d * e, dense))
            out.append(("reduce_scatter", n, group * d * e, dense))
        elif module == "lm_head":
            out.append(("all_gather", n, n * seqs * d * e, 1))
            out.append(("all_to_all", n, n * seqs * shape.vocab / tp * 4, 1))
        elif module == "embed":
            out.append(("all_gather", n, group * 8, 1))
            out.append(("reduce_scatter", n, group * d * e, 1))
    return out


def choose_plan(
    model_config: Any,
    devices: int,
    device: Device | str,
    memory_per_device: float,
    workload: Workload,
    *,
    quant: QuantConfig | None = None,
) -> tuple[Placement, Report]:
    """The fastest plan (and its mesh) for ``model_config`` on ``devices`` devices of ``device`` with
    ``memory_per_device`` bytes each, and the report of every candidate.

    Returns:
        ``(placement, report)``: the chosen plan's :class:`~functional_npu.placement.Placement` (its ``plan`` with
        the prefetch step when layer-sharded, its ``mesh_shape`` the mesh's axis sizes; ``to_json()`` the plan file).

    Raises:
        PlanDoesNotFit: no candidate fits; the message names the smallest memory per device that would fit and
            the plan that would use it.
        ValueError: an unknown device (the message lists the known ones), a bad budget or workload, or a family
            without cost rules.
    """
    dev = device_profile(device)
    if isinstance(memory_per_device, bool) or not (
        isinstance(memory_per_device, (int, float)) and 0 < memory_per_device < math.inf
    ):
        raise ValueError(
            f"choose_plan: memory_per_device must be a positive number of bytes, got {memory_per_device!r}"
        )
    if not isinstance(workload, Workload):
        raise ValueError(f"choose_plan: workload must be a Workload (decode or prefill), got {workload!r}")
    estimates, refused = [], []
    for c in candidates(model_config, devices):
        try:
            estimates.append(estimate(model_config, c, dev, workload, memory_per_device=memory_per_device, quant=quant))
        except ValueError as e:
            refused.append((c.name, " ".join(str(e).split())))
    if not estimates:
        raise ValueError(
            f"choose_plan: no candidate plan of {model_config.architecture} runs on {devices} devices: "
            + "; ".join(f"{n}: {w}" for n, w in refused[:3])
        )
    ranked = sorted(estimates, key=lambda x: (not x.fits, x.step_s, x.bytes["total"], x.candidate.name))
    report = Report(model_config.architecture, dev, devices, memory_per_device, workload, ranked, refused)
    if not ranked[0].fits:
        least = min(estimates, key=lambda x: (x.bytes["total"], x.step_s))
        raise PlanDoesNotFit(
            f"choose_plan: no plan of {model_config.architecture} on {devices} x {dev.name} fits "
            f"{_gb(memory_per_device)} per device for {workload}; the smallest need is "
            f"{_gb(least.bytes['total'])} per device ({least.candidate.name}): give each device at least that, "
            f"or use more devices"
        )
    return ranked[0].placement, report
