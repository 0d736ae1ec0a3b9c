"""Choose the plan: every candidate plan of a model on ``n`` devices, ranked for a workload.

:func:`choose_plan` answers "this model, these devices, this much memory each, this workload: which plan serves it
best, and does it fit?". It enumerates the candidates (:func:`candidates`: every ``dp x tp`` split, expert
parallelism for a model with experts, each module's TP over the dp ranks, layer-sharded series with the
prefetch step the cost model picks) and prices each: for a fixed batch (decode or prefill), by its modelled step
(:func:`~.step_model.estimate`), the fastest that fits winning; for a serving workload, by the batch the budget
admits and the tokens/s per device it serves (:func:`~.serve.serve_estimate`), the most winning. A plan the model
cannot run is reported with the reason, never ranked; so is a layer-sharded plan that saves no memory (its owned
layers and ring hold at least what the same split holds replicated).

The report says why the winner won (the runner-up, and what the better plans lacked in memory); a refusal names
the smallest memory per device that would fit, rounded up so that the figure given back is accepted. Nothing here
reads a checkpoint or starts a process.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from ...parallel.devices import Device
from ...parallel.devices import device as device_profile
from ...parallel.layer_shard import layer_shard
from ...parallel.module_tp import MODULES, split_dp
from ...parallel.plan import Plan
from ...placement.placement import Placement
from ...placement.quant_config import QuantConfig
from .disaggregated import Disaggregated, best_split
from .serve import Served, serve_estimate
from .step_model import (
    Candidate,
    Estimate,
    Workload,
    check_formats,
    check_positions,
    check_request,
    cost_shape,
    estimate,
)

# the most devices a plan is made for (every candidate's bytes are counted at every rank)
MAX_DEVICES = 1024
MAX_MEMORY = 10**18  # bytes per device (an exabyte): past it a serving workload's batch search overflows a float

__all__ = [
    "Report",
    "candidates",
    "choose_plan",
    "simplest",
    "techniques",
    "PlanDoesNotFit",
    "MAX_DEVICES",
    "MAX_MEMORY",
    "gb_at_least",
]

SERIES_CHOICES = ("o_proj", "o_proj,down_proj", "layer")  # the layer-sharded series a candidate may use


class PlanDoesNotFit(ValueError):
    """No candidate fits the memory budget; the message names the smallest memory that would and its plan.

    Attributes:
        need: that memory in bytes (exact); ``figure``: as the message states it, rounded up (never below ``need``).
        plan: the candidate that would use it.
    """

    def __init__(self, message: str, need: int = 0, figure: str = "", plan: str = ""):
        super().__init__(message)
        self.need, self.figure, self.plan = need, figure, plan


Ranked = Estimate | Served | Disaggregated


@dataclass(frozen=True)
class Report:
    """Every candidate considered, ranked (fitting ones first; then the fastest step for a fixed batch, the most
    tokens/s per device for a serving workload), the chosen one (the first, always one this library runs) and why.
    Candidates it does not run yet (two-batch overlap, prefill and decode on separate groups) are ranked among the
    rest and marked, for what they would gain."""

    model: str
    device: Device
    devices: int
    memory_per_device: float
    workload: Workload
    ranked: list[Ranked]
    refused: list[tuple[str, str]] = field(default_factory=list)  # (candidate, why it is not ranked)
    rule: str = ""  # why the chosen plan, not a more complex one that models better (:func:`simplest`)

    @property
    def chosen(self) -> Ranked:
        return self.ranked[0]

    @property
    def serving(self) -> bool:
        return self.workload.kind == "serve"

    def why(self) -> str:
        """One paragraph: the winner's figure and bytes, the runner-up, and the better plans that did not fit."""
        best = self.chosen
        fitting = [e for e in self.ranked if e.fits]
        out = f"{best.candidate.name}: {_figure(best)} (+-{self.device.prediction_spread:.0%}, the profile's "
        out += f"{'fit' if self.device.spread is not None else 'assumed spread'}), {_gb(best.bytes['total'])} per "
        out += f"rank of {_gb(self.memory_per_device)}, waiting on {best.bottleneck}"
        if self.rule:
            out += f"; chosen by {self.rule}"
        if len(fitting) > 1:
            out += f"; the next best that fits, {fitting[1].candidate.name}: {_figure(fitting[1])}"
        ahead = [e for e in fitting if not e.runs and _key(self.workload, e) < _key(self.workload, best)]
        if ahead:
            gain = _gain(self.workload, ahead[0], best)
            out += (
                f"; not yet run by this library, {ahead[0].candidate.name} is modelled {gain:.0%} better "
                f"({_figure(ahead[0])})"
            )
        better = [e for e in self.ranked if not e.fits and _key(self.workload, e)[1:2] < _key(self.workload, best)[1:2]]
        if better and not self.serving:
            f = min(better, key=lambda e: e.step_s)
            out += (
                f"; {len(better)} faster plan(s) do not fit, the fastest {f.candidate.name} "
                f"({f.step_s * 1e3:.3g} ms) needs {_gb(f.bytes['total'])}"
            )
        return out

    def table(self) -> str:
        """The ranked table (plan, figures, bytes per rank by kind, bottleneck, fits), as Markdown."""
        head = "| rank | plan | step ms |" if not self.serving else "| rank | plan | batch | tok/s/device | step ms |"
        lines = [
            f"{self.model} on {self.devices} x {self.device.name} ({_gb(self.memory_per_device)} each), "
            f"{self.workload}",
            "",
            head + " weights | KV cache | prefetch | activations | total / rank | bottleneck | fits |",
            "|---" * (head.count("|") + 6) + "|",
        ]
        for i, e in enumerate(self.ranked, 1):
            b = e.bytes
            served = f" {e.batch} | {e.per_device:.4g} |" if self.serving else ""
            name = e.candidate.name + ("" if e.runs else " (not yet run by this library)")
            lines.append(
                f"| {i} | {name} |{served} {e.step_s * 1e3:.3g} | {_gb(b['weights'])} "
                f"| {_gb(b['kv_cache'])} | {_gb(b['prefetch'])} | {_gb(b['activations'])} | {_gb(b['total'])} "
                f"| {e.bottleneck} | {'yes' if e.fits else 'no'} |"
            )
        if self.refused:
            lines += ["", f"{len(self.refused)} candidate(s) not ranked:"]
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
            "rule": self.rule,
            "spread": self.device.prediction_spread,
            "candidates": [e.row() for e in self.ranked],
            "refused": [{"plan": n, "why": w} for n, w in self.refused],
        }


def _figure(e: Ranked) -> str:
    if isinstance(e, Served):
        return f"{e.batch} sequences at once, {e.per_device:.4g} tokens/s per device"
    return f"{e.step_s * 1e3:.3g} ms per step"


def _key(workload: Workload, e: Ranked) -> tuple:
    """The ranking: fitting first; the most tokens/s per device (serving) or the fastest step; then fewer bytes."""
    figure = -e.per_device if workload.kind == "serve" else e.step_s
    return (not e.fits, figure, e.bytes["total"], e.candidate.name)


_UNITS = (("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def _gb(n: float) -> str:
    """Bytes in decimal units (GB = 1e9 bytes, as device memory is stated)."""
    for unit, size in _UNITS:
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def gb_at_least(n: int) -> str:
    """``n`` bytes in decimal units with two decimals, rounded up: the figure, read back as that many units
    (``Decimal``), is never below ``n`` (``_gb`` rounds to nearest, which can name a memory that is refused)."""
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not 0 <= n < math.inf:
        raise ValueError(f"gb_at_least: n must be a finite number of bytes >= 0, got {n!r}")
    for unit, size in _UNITS:
        if n >= size:
            hundredths = -(-int(n) * 100 // size)
            return f"{hundredths // 100}.{hundredths % 100:02d} {unit}"
    return f"{math.ceil(n)} B"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: Any, devices: int, *, host_link: bool = False) -> list[Candidate]:
    """Every plan the planner weighs for ``cfg`` on ``devices`` ranks (not yet checked against the model):
    for each ``tp`` dividing ``devices`` (``dp = devices / tp``): the plain plan; expert parallelism over all
    ranks (a model with experts; redundant copies where the devices do not divide the experts); each module's TP
    over all dp ranks, and all of them at once; each layer-sharded series of :data:`SERIES_CHOICES` over dp; the
    expert-parallel plan under two-batch overlap (priced, not run by this library: ``Candidate.runs``); with
    ``host_link`` (a device with a host link), each series of :data:`SERIES_CHOICES` kept in host memory (prefetch
    step chosen when estimated)."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"choose_plan: devices must be a positive int, got {devices!r}")
    if devices > MAX_DEVICES:
        raise ValueError(
            f"choose_plan: {devices} devices is more than the planner weighs ({MAX_DEVICES}): it counts every "
            f"candidate's bytes at every rank, so its work grows with the devices; plan one node's or one replica's "
            f"devices (at most {MAX_DEVICES}) and repeat that plan over the rest with data parallelism"
        )
    experts = getattr(cost_shape(cfg), "experts", 0)
    out: list[Candidate] = []
    for tp in _divisors(devices):
        dp = devices // tp
        axes = {"dp": dp, "tp": tp}
        base = f"dp {dp} x tp {tp}"
        out.append(Candidate(base, axes, Plan()))
        if experts and devices > 1:
            out.append(Candidate(f"{base}, EP {devices}", axes, _ep_plan(experts, devices)))
            overlap = f"{base}, EP {devices}, two-batch overlap"
            out.append(Candidate(overlap, axes, _ep_plan(experts, devices), schedule="two_batch"))
        if dp > 1:
            for modules in [(m,) for m in MODULES] + [MODULES]:
                split, mtp = split_dp(axes, {m: dp for m in modules})
                label = "all modules" if modules == MODULES else modules[0]
                out.append(Candidate(f"{base}, {label} TP {dp}", split, Plan(module_tp=mtp)))
            for series in SERIES_CHOICES:
                ls = layer_shard(series, "dp")
                out.append(Candidate(f"{base}, {series} layer-sharded over dp", axes, Plan(layer_shard=ls)))
        if host_link:
            for series in SERIES_CHOICES:
                out.append(Candidate(f"{base}, {series} in host memory", axes, Plan(offload=series)))
    return out


def _ep_plan(experts: int, devices: int) -> Plan:
    """Experts over every device; where the devices do not divide the experts, redundant copies (EPLB) fill the
    slots up to the next multiple (256 experts on 72 devices: 288 slots, 4 a device, 32 experts with two copies)."""
    if experts % devices == 0:
        return Plan(expert_axes=("dp", "tp"))
    slots = -(-experts // devices) * devices
    return Plan(expert_axes=("dp", "tp"), num_slots=slots, max_copies=-(-slots // experts))


def choose_plan(
    model_config: Any,
    devices: int,
    device: Device | str,
    memory_per_device: float,
    workload: Workload,
    *,
    quant: QuantConfig | None = None,
    dispatch: str = "runtime",
) -> tuple[Placement, Report]:
    """The best plan (and its mesh) for ``model_config`` on ``devices`` devices of ``device`` with
    ``memory_per_device`` bytes each, and the report of every candidate: the fastest step that fits for a fixed
    batch, the most tokens/s per device at the batch the memory admits for a serving workload; of those, the
    simplest (:func:`simplest`): a technique is kept only where no plan without it fits or it gains more than the
    profile's spread. ``dispatch``: how expert parallelism is priced (:func:`~.step_model.estimate`).

    Returns:
        ``(placement, report)``: the chosen plan's :class:`~functional_npu.placement.Placement` (its ``plan`` with
        the prefetch step when layer-sharded, its ``mesh_shape`` the mesh's axis sizes; ``to_json()`` the plan file).

    Raises:
        PlanDoesNotFit: no candidate fits (serving: not one sequence); the message names the smallest memory per
            device that would fit, rounded up, and the plan that would use it.
        ValueError: an unknown device (the message lists the known ones), a bad budget or workload, or a family
            without cost rules.
    """
    dev = device_profile(device)
    if isinstance(memory_per_device, bool) or not (
        isinstance(memory_per_device, (int, float)) and 1 <= memory_per_device <= MAX_MEMORY
    ):
        raise ValueError(
            f"choose_plan: memory_per_device must be a number of bytes in [1, {MAX_MEMORY:.0e}], got "
            f"{memory_per_device!r}"
        )
    if not isinstance(workload, Workload):
        raise ValueError(f"choose_plan: workload must be a Workload (decode, prefill or serve), got {workload!r}")
    check_request(None, workload, memory_per_device, quant, dispatch, "choose_plan", candidates=False)
    _check_profile(dev)
    check_formats(workload, dev)
    check_positions(model_config, workload)
    if dev.step_overhead_s is None:
        warnings.warn(
            f"choose_plan: the device profile {dev.name!r} has no fixed cost per step (step_overhead_s), measured or "
            f"fitted: its figures are the roofline only, optimistic by the host's and launches' share of each step",
            stacklevel=2,
        )
    estimates, refused = _priced(model_config, devices, dev, workload, memory_per_device, quant, dispatch)
    if not any(e.runs for e in estimates):
        raise ValueError(
            f"choose_plan: no candidate plan of {model_config.architecture} runs on {devices} devices: "
            + "; ".join(f"{n}: {w}" for n, w in refused[:3])
        )
    ranked = sorted(estimates, key=lambda e: _key(workload, e))
    runnable = [e for e in ranked if e.runs]
    rule = ""
    if runnable[0].fits:
        chosen, rule = simplest(runnable, workload, dev.prediction_spread)
        ranked.remove(chosen)
        ranked.insert(0, chosen)
    report = Report(model_config.architecture, dev, devices, memory_per_device, workload, ranked, refused, rule)
    if not runnable[0].fits:
        least = min(runnable, key=lambda x: (x.bytes["total"], x.step_s))
        need, figure = least.bytes["total"], gb_at_least(least.bytes["total"])
        what = f"serves one sequence of {workload.context} positions in" if report.serving else "fits"
        raise PlanDoesNotFit(
            f"choose_plan: no plan of {model_config.architecture} on {devices} x {dev.name} {what} "
            f"{_gb(memory_per_device)} per device for {workload}; the smallest need is {figure} per device "
            f"({least.candidate.name}): give each device at least that, or use more devices",
            need,
            figure,
            least.candidate.name,
        )
    return ranked[0].placement, report


def techniques(plan: Plan) -> frozenset[str]:
    """What a plan adds to its ``dp x tp`` split: ``"EP"``, ``"module TP"``, ``"layer sharding"``,
    ``"host memory"``."""
    if not isinstance(plan, Plan):
        raise TypeError(f"techniques: plan must be a functional_npu.Plan, got {type(plan).__name__}")
    on = {
        "EP": bool(plan.expert_axes),
        "module TP": bool(plan.module_tp),
        "layer sharding": plan.layer_shard is not None,
        "host memory": bool(plan.offload),
    }
    return frozenset(name for name, used in on.items() if used)


def _gain(workload: Workload, better: Ranked, than: Ranked) -> float:
    """How much ``better``'s figure beats ``than``'s, relative (tokens/s per device, or the step time)."""
    if workload.kind == "serve":
        return better.per_device / than.per_device - 1 if than.per_device > 0 else math.inf
    return than.step_s / better.step_s - 1


def simplest(ranked: list[Ranked], workload: Workload, spread: float) -> tuple[Ranked, str]:
    """The plan to choose from ``ranked`` (best first, the first fitting): the best fitting plan, unless a fitting
    plan with a strict subset of its techniques (:func:`techniques`) comes within ``spread`` of it, in which case
    that one, and so on down. Returns the plan and the rule that decided, in words."""
    fitting = [e for e in ranked if e.fits]
    if not fitting:
        raise ValueError(
            f"simplest: none of the {len(ranked)} ranked plans fits; it chooses among fitting ones (choose_plan "
            f"raises PlanDoesNotFit with the memory that would fit instead)"
        )
    best = chosen = fitting[0]
    while have := techniques(chosen.candidate.plan):
        simpler = [e for e in fitting if techniques(e.candidate.plan) < have]
        if not simpler:
            return chosen, f"needed to fit: no plan without {', '.join(sorted(have))} fits"
        alternative = simpler[0]  # the best of them (fitting is in ranked order)
        gain = _gain(workload, chosen, alternative)
        if gain > spread:
            return chosen, (
                f"gain: {', '.join(sorted(have - techniques(alternative.candidate.plan)))} beats "
                f"{alternative.candidate.name} by {gain:.0%}, more than the model's spread ({spread:.0%})"
            )
        chosen = alternative
    if chosen is best:
        return chosen, "the best plan uses no technique beyond its dp x tp split"
    return chosen, (
        f"simplest: {best.candidate.name} is modelled {_gain(workload, best, chosen):.0%} better, within the "
        f"model's spread ({spread:.0%}); its techniques are not worth their risk"
    )


def _priced(
    cfg: Any,
    devices: int,
    dev: Device,
    workload: Workload,
    memory: float,
    quant: QuantConfig | None,
    dispatch: str = "runtime",
) -> tuple[list[Ranked], list[tuple[str, str]]]:
    """Every candidate priced for ``workload``, and the ones not ranked with why: those the model cannot run,
    and the layer-sharded ones that save no memory against the same split replicated."""
    priced: list[Ranked] = []
    refused: list[tuple[str, str]] = []
    for c in candidates(cfg, devices, host_link=dev.host_link is not None):
        try:
            if workload.kind == "serve":
                priced.append(
                    serve_estimate(cfg, c, dev, workload, memory_per_device=memory, quant=quant, dispatch=dispatch)
                )
            else:
                priced.append(estimate(cfg, c, dev, workload, memory_per_device=memory, quant=quant, dispatch=dispatch))
        except ValueError as e:
            refused.append((c.name, " ".join(str(e).split())))
    replicated = {_axes_key(e): e.bytes["weights"] for e in priced if e.candidate.plan == Plan()}
    kept = []
    for e in priced:
        plain = replicated.get(_axes_key(e))
        held = e.bytes["weights"] + e.bytes["prefetch"]
        if e.candidate.plan.layer_shard is not None and plain is not None and held >= plain:
            refused.append((e.candidate.name, _no_saving(e, held, plain)))
        else:
            kept.append(e)
    if workload.kind == "serve" and workload.prompt_len and devices > 1:  # prefill and decode on separate groups

        def sides(n: int) -> list[Candidate]:
            return [c for c in candidates(cfg, n) if c.runs and techniques(c.plan) <= {"EP"}]

        split, why_not = best_split(cfg, devices, sides, dev, workload, memory, quant, dispatch)
        kept += split
        refused += why_not
    return kept, refused


def _axes_key(e: Ranked) -> tuple:
    return tuple(sorted(e.candidate.axes.items()))


def _no_saving(e: Ranked, held: int, plain: int) -> str:
    k = e.candidate.plan.prefetch_step
    return (
        f"its owned layers and a ring of {k} + 1 slots hold {_gb(held)} of weights per rank, {held / plain:.0%} "
        f"of the {_gb(plain)} the same split holds replicated: it saves no memory"
    )


def _check_profile(dev: Device) -> None:
    """The figures every objective reads are positive and finite: one line naming the first that is not."""
    figures = {
        "memory_bytes_per_s": dev.memory_bytes_per_s,
        "flop_per_s": dev.flop_per_s,
        "link.bytes_per_s": dev.link.bytes_per_s,
        "link.alpha_s": dev.link.alpha_s + 1,  # may be 0
    }
    if dev.inter_node is not None:
        figures["inter_node.bytes_per_s"] = dev.inter_node.bytes_per_s
    for name, value in figures.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            shown = value - 1 if name == "link.alpha_s" else value
            raise ValueError(
                f"choose_plan: the device profile {dev.name!r} needs a positive finite {name} to price a plan, "
                f"got {shown!r}; give the figure (see functional_npu.parallel.devices.DEVICES for sourced ones)"
            )
