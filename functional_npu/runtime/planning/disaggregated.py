"""Prefill and decode on separate device groups: a disaggregated serving deployment priced as one candidate.

A serving workload with prompt tokens (:meth:`~.step_model.Workload.serve`, share ``s`` of the tokens processed
being prompt tokens) can run its prefills on one group of devices and its decode steps on another, each under
its own plan, the prompt's KV cache moved from the prefill group to the decode group once per sequence.
:func:`disaggregated_estimate` prices such a split:

- **the prefill group** (``p`` devices under its plan) runs one prompt per data-parallel rank per step
  (:func:`~.step_model.estimate`): ``P`` prompt tokens/s; it must hold the weights and one prompt's cache;
- **the decode group** (``q`` devices) serves the sequences it is handed at the batch its memory admits
  (:func:`~.serve.serve_estimate` with ``decode_only``): ``D`` generated tokens/s;
- **the KV transfer**: each prompt's cache, as the decode group's paged pools hold it
  (:func:`~.step_model.sequence_kv_bytes`), received by every rank of one decode data-parallel group at once over
  the link between the groups (the inter-node link once the ``p + q`` devices span nodes): ``K`` prompts/s;
- **tokens/s**: the whole deployment serves ``min(min(P, K x prompt) / s, D / (1 - s))`` tokens of both kinds,
  the slower side bounding the other; ranked per device of ``p + q``.

This library does not run a disaggregated deployment yet: the planner shows it beside the plans it runs and never
chooses it (:attr:`Disaggregated.runs`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...core.mesh import Mesh
from ...parallel.devices import Device
from ...parallel.devices import device as device_profile
from ...parallel.module_tp import dp_axes
from ...placement.placement import Placement
from ...placement.quant_config import QuantConfig
from .serve import Served, serve_estimate
from .step_model import Candidate, Estimate, Workload, check_request, estimate, sequence_kv_bytes

__all__ = ["Disaggregated", "disaggregated_estimate", "splits", "best_split"]


@dataclass(frozen=True)
class Disaggregated:
    """A disaggregated candidate under a serving workload.

    Attributes:
        candidate: the decode group's candidate, named for the whole split.
        prefill_devices / decode_devices: the two groups' sizes.
        prefill: one prompt per prefill data-parallel rank; ``decode``: the decode group served.
        kv_bytes: one prompt's cache received by each decode rank; ``kv_s``: its transfer's time.
        tokens_per_s: prompt and generated tokens per second; ``per_device``: over both groups' devices.
        limit: the side that bounds it (``"prefill"``, ``"KV transfer"`` or ``"decode"``).
        bytes / fits: the decode group's busiest rank; the prefill group must fit too.
    """

    candidate: Candidate
    prefill_candidate: Candidate
    prefill_devices: int
    decode_devices: int
    prefill: Estimate
    decode: Served
    kv_bytes: int
    kv_s: float
    tokens_per_s: float
    per_device: float
    limit: str
    bytes: dict[str, int]
    fits: bool
    placement: Placement = field(repr=False)

    runs = False  # this library does not run a disaggregated deployment yet

    @property
    def batch(self) -> int:
        return self.decode.batch

    @property
    def step_s(self) -> float:
        return self.decode.step_s

    @property
    def bottleneck(self) -> str:
        if self.limit == "decode":
            return self.decode.bottleneck
        return "KV transfer" if self.limit == "KV transfer" else f"prefill {self.prefill.bottleneck}"

    def row(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "plan": self.candidate.name,
            "runs": False,
            "prefill": {"plan": self.prefill_candidate.name, "devices": self.prefill_devices,
                        "step_ms": self.prefill.step_s * 1e3, "bytes_per_rank": self.prefill.bytes},
            "decode": dict(self.decode.row(), devices=self.decode_devices),
            "kv_bytes_per_sequence_per_rank": self.kv_bytes,
            "kv_transfer_ms": self.kv_s * 1e3,
            "batch": self.batch,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_device": self.per_device,
            "limit": self.limit,
            "bytes_per_rank": self.bytes,
            "bottleneck": self.bottleneck,
            "fits": self.fits,
        }  # fmt: skip


def disaggregated_estimate(
    cfg: Any,
    prefill: Candidate,
    decode: Candidate,
    device: Device | str,
    workload: Workload,
    *,
    memory_per_device: float,
    quant: QuantConfig | None = None,
    dispatch: str = "runtime",
) -> Disaggregated:
    """The split ``prefill`` / ``decode`` (each a candidate over its own group) under the serving ``workload``
    (module docstring).

    Raises:
        ValueError: a side with no devices, a workload without prompt tokens or not a serving one, or a side's
            plan the model cannot run (its message).
    """
    for c in (prefill, decode):
        check_request(c, workload, memory_per_device, quant, dispatch, "disaggregated_estimate")
    for side, c in (("prefill", prefill), ("decode", decode)):
        if not c.axes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in c.axes.values()):
            raise ValueError(
                f"disaggregated: the {side} side has no devices (axes {c.axes}); give each side at least one "
                f"device, or plan the whole deployment as one group"
            )
    if workload.kind != "serve" or not workload.prompt_len:
        raise ValueError(
            f"disaggregated: needs a serving workload with prompt tokens (Workload.serve with prompt_share > 0): a "
            f"prefill group has nothing to do otherwise; got {workload}"
        )
    dev = device_profile(device)
    pre = _prefill_side(cfg, prefill, dev, workload, memory_per_device, quant, dispatch)
    served = _decode_side(cfg, decode, dev, workload, memory_per_device, quant, dispatch)
    return _together(cfg, prefill, decode, pre, served, dev, workload)


def _prefill_side(
    cfg: Any, c: Candidate, dev: Device, workload: Workload, memory: float, quant: QuantConfig | None, dispatch: str
) -> Estimate:
    """The prefill group's step: one prompt per data-parallel rank, in the workload's formats."""
    settings = {"weights": workload.weights, "kv_dtype": workload.kv_dtype}
    work = Workload.prefill(workload.prompt_len, _dp(c), workload.dtype).with_(**settings)
    return estimate(cfg, c, dev, work, memory_per_device=memory, quant=quant, dispatch=dispatch)


def _decode_side(
    cfg: Any, c: Candidate, dev: Device, workload: Workload, memory: float, quant: QuantConfig | None, dispatch: str
) -> Served:
    """The decode group served: its sequences arrive prefilled."""
    return serve_estimate(cfg, c, dev, workload, memory_per_device=memory, quant=quant, dispatch=dispatch,
                          decode_only=True)  # fmt: skip


def _together(
    cfg: Any, prefill: Candidate, decode: Candidate, pre: Estimate, served: Served, dev: Device, workload: Workload
) -> Disaggregated:
    """The two sides priced together: the KV transfer between them, the side that bounds the rate."""
    prompt = workload.prompt_len
    p, q = prefill.devices, decode.devices
    kv = sequence_kv_bytes(cfg, decode, prompt, workload.cache_dtype)
    spans = dev.nodes_spanned(range(p + q)) if dev.node_size is not None else 1
    kv_s = dev.link_for(spans).time(kv)
    prompts_in = _dp(prefill) * prompt / pre.step_s  # prompt tokens/s the prefill group computes
    carried = _dp(decode) / kv_s * prompt  # prompt tokens/s the link delivers (one transfer per decode dp group)
    share = prompt / workload.context
    bounds = {
        "prefill": prompts_in / share,
        "KV transfer": carried / share,
        "decode": served.tokens_per_s / (1 - share) if served.batch else 0.0,
    }
    limit = min(bounds, key=lambda k: bounds[k])
    rate = bounds[limit] if pre.fits and served.fits else 0.0
    name = f"disaggregated: prefill {prefill.name} on {p}, decode {decode.name} on {q}"
    return Disaggregated(
        dataclasses.replace(decode, name=name), prefill, p, q, pre, served, kv, kv_s, rate, rate / (p + q), limit,
        served.bytes, pre.fits and served.fits, served.placement,
    )  # fmt: skip


def _dp(c: Candidate) -> int:
    mesh = Mesh.abstract(c.axes, 0)
    return mesh.axis_size(dp_axes(mesh, c.plan.tp))


def splits(devices: int) -> list[int]:
    """The prefill group sizes the planner weighs on ``devices``: a quarter, a half and three quarters (those that
    leave both sides a device)."""
    return sorted({p for p in (devices // 4, devices // 2, 3 * devices // 4) if 1 <= p < devices})


def best_split(
    cfg: Any,
    devices: int,
    side_candidates: Any,
    device: Device,
    workload: Workload,
    memory: float,
    quant: QuantConfig | None,
    dispatch: str,
) -> tuple[list[Disaggregated], list[tuple[str, str]]]:
    """For each split of :func:`splits`, the best prefill side and the best decode side (their own figures, among
    ``side_candidates(n)``'s plans), priced together; and the splits refused, with why."""
    out: list[Disaggregated] = []
    refused: list[tuple[str, str]] = []
    for p in splits(devices):
        pre_best = dec_best = None  # (key, candidate, its figure): priced once, combined as found
        for c in side_candidates(p):
            try:
                e = _prefill_side(cfg, c, device, workload, memory, quant, dispatch)
            except ValueError:
                continue
            key = (not e.fits, -_dp(c) * workload.prompt_len / e.step_s)
            if pre_best is None or key < pre_best[0]:
                pre_best = (key, c, e)
        for c in side_candidates(devices - p):
            try:
                s = _decode_side(cfg, c, device, workload, memory, quant, dispatch)
            except ValueError:
                continue
            key = (not s.fits, -s.tokens_per_s)
            if dec_best is None or key < dec_best[0]:
                dec_best = (key, c, s)
        if pre_best is None or dec_best is None:
            refused.append((f"disaggregated, prefill on {p} of {devices}", "no plan of one side runs the model"))
            continue
        out.append(_together(cfg, pre_best[1], dec_best[1], pre_best[2], dec_best[2], device, workload))
    return out, refused
