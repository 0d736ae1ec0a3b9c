"""How far ahead to prefetch: a cost model of the layer-shard schedule, and the choice of ``k``.

The schedule (:mod:`functional_npu.parallel.prefetch`) issues layer ``j``'s broadcast as layer
``j - k`` starts, after every use of layer ``j - k - 1``, and layer ``j`` waits for it. Broadcasts
share one link and run one after another; compute runs layer after layer. :func:`step_time`
simulates exactly that for a few steps (the first ``k`` layers of a step are fetched during the last
``k`` of the previous one) and returns the steady per-step time, so the predicted exposed fraction is
``(T - L * compute) / (L * comm)``, the benchmark's definition.

:func:`choose_k` is ``prefetch_step="auto"``: the smallest ``k`` whose predicted exposure is within
``margin`` of the best any ``k`` can reach, among those whose ``k + 1`` live buffers fit the byte
budget. Inputs are plain numbers: bytes per layer (all layer-sharded series, fetched together), an
alpha-beta :class:`Link`, and per-layer compute time, from :func:`roofline_layer_s` with a
:class:`Device`'s published figures or from a measurement.
"""

from __future__ import annotations

import math
from typing import Any

import torch.utils._pytree as pytree

from ..core.numbers import is_finite, is_int
from ..core.quant import Quant
from .devices import DEVICES, Device, Link
from .plan import Plan

__all__ = [
    "check_budget",
    "Link",
    "Device",
    "DEVICES",
    "step_time",
    "simulate",
    "exposed",
    "choose_k",
    "roofline_layer_s",
    "auto_step",
    "layer_bytes",
    "layer_weight_bytes",
    "host_layer_bytes",
    "host_step",
    "layer_weight_elements",
]


def roofline_layer_s(device: Device, weight_bytes: float, flops: float) -> float:
    """One layer's compute time at the roofline: reading its weights once or doing its FLOPs, whichever
    takes longer (decode is the first, large prefill the second)."""
    if not isinstance(device, Device):
        raise TypeError(f"roofline_layer_s: device must be a Device (e.g. DEVICES['h100-sxm']), got {device!r}")
    for name, value in {"weight_bytes": weight_bytes, "flops": flops}.items():
        if not is_finite(value) or value < 0:
            raise ValueError(f"roofline_layer_s: {name} must be a finite number >= 0, got {value!r}")
    return max(weight_bytes / device.memory_bytes_per_s, flops / device.flop_per_s)


def _check(num_layers: int, k: int, compute_s: float, occupy_s: float, latency_s: float, where: str) -> None:
    times = {"compute_s": compute_s, "occupy_s": occupy_s, "latency_s": latency_s}
    for name, value in times.items():
        if not is_finite(value):
            raise ValueError(
                f"{where}: {name} must be a finite number of seconds >= 0, got {value!r}; give the measured or "
                f"modelled time (roofline_layer_s, Link.time)"
            )
    if not is_int(num_layers, 1) or not is_int(k, 0) or min(times.values()) < 0 or latency_s < occupy_s:
        raise ValueError(
            f"{where}: needs num_layers >= 1, k >= 0, times >= 0 and latency >= occupancy; got "
            f"L={num_layers}, k={k}, compute={compute_s}, occupy={occupy_s}, latency={latency_s}"
        )


def simulate(num_layers: int, k: int, compute_s: float, occupy_s: float, latency_s: float, steps: int) -> list[float]:
    """When each layer of ``steps`` consecutive steps ends, event by event.

    A broadcast holds the link for ``occupy_s`` (bytes over bandwidth) and arrives ``latency_s`` after it
    starts (``alpha`` more). Layer ``g`` (counting across steps) starts when layer ``g - 1`` ended and
    its broadcast arrived; the broadcast of ``g`` starts when the link is free and layer ``g - k - 1``
    ended (``k = 0``: as layer ``g - 1`` ends). The first step's first ``k`` layers are in place at 0.
    """
    _check(num_layers, k, compute_s, occupy_s, latency_s, "simulate")
    if not is_int(steps, 1):
        raise ValueError(f"simulate: steps must be an int >= 1, got {steps!r}")
    end = [0.0] * (num_layers * steps)
    link_free = done = 0.0
    for g in range(len(end)):
        arrive = 0.0
        if g >= k:
            start = max(link_free, end[g - k - 1] if g - k - 1 >= 0 else 0.0)
            link_free = start + occupy_s
            arrive = start + latency_s
        done = end[g] = max(done, arrive) + compute_s
    return end


def step_time(num_layers: int, k: int, compute_s: float, occupy_s: float, latency_s: float | None = None) -> float:
    """Steady per-step time of the schedule with prefetch distance ``k`` (see :func:`simulate`).

    The schedule is a max-plus system whose steady time per layer is its largest cycle mean:
    ``max(compute, occupy, (latency + compute) / (k + 1))`` -- the compute chain, the link, and the
    loop from the end of layer ``g - k - 1`` through the broadcast of ``g`` to the end of layer ``g``,
    which spans ``k + 1`` layers. ``latency_s`` defaults to ``occupy_s`` (no alpha).
    """
    latency_s = occupy_s if latency_s is None else latency_s
    _check(num_layers, k, compute_s, occupy_s, latency_s, "step_time")
    if latency_s == 0:
        return num_layers * compute_s
    return num_layers * max(compute_s, occupy_s, (latency_s + compute_s) / (k + 1))


def exposed(num_layers: int, k: int, compute_s: float, occupy_s: float, latency_s: float | None = None) -> float:
    """Predicted exposed fraction ``(T - L * compute) / (L * latency)`` (0 without communication): the
    benchmark's ``(T - T_local) / T_comm_alone`` with broadcasts alone taking their latency each."""
    latency_s = occupy_s if latency_s is None else latency_s
    _check(num_layers, k, compute_s, occupy_s, latency_s, "exposed")
    if latency_s == 0:
        return 0.0
    t = step_time(num_layers, k, compute_s, occupy_s, latency_s)
    return (t - num_layers * compute_s) / (num_layers * latency_s)


def check_budget(budget_bytes: float, layer_bytes: int, series: str, where: str = "") -> None:
    """Refuse a prefetch ring budget that cannot hold one layer of ``series`` (``layer_bytes``: the ring's one slot,
    needed even at ``k = 0``); ``where`` starts the message."""
    if budget_bytes < layer_bytes:
        raise ValueError(
            f"{f'{where}: ' if where else ''}prefetch_step='auto': the prefetch ring budget of {budget_bytes:.0f} "
            f"bytes does not hold one layer of {series} ({layer_bytes} bytes, needed even at k = 0); raise the "
            f"budget or layer-shard fewer series"
        )


def choose_k(
    layer_bytes: int,
    *,
    num_layers: int,
    compute_s: float,
    link: Link,
    budget_bytes: float | None = None,
    margin: float = 0.25,
    series: str = "the layer-sharded series",
) -> int:
    """The prefetch distance for ``prefetch_step="auto"``: the smallest ``k`` whose window of ``k``
    layers of compute covers one broadcast's latency with ``margin`` to spare,
    ``ceil((1 + margin) * latency / compute)``, within ``0 .. L - 1`` (a ring of at most ``L`` slots) and the
    byte budget.

    Where the link keeps up (a broadcast holds it no longer than a layer computes) that ``k`` hides
    every broadcast (see :func:`exposed`). Where it does not, no ``k`` hides the difference in the
    steady state, but the covering ``k`` still absorbs a slow broadcast: measured on an emulated link
    with broadcast and compute within 10% of each other, ``k = 1`` left 17-21% exposed and ``k = 2``
    4-14% (see benchmarks/README.md).

    Args:
        layer_bytes: bytes one layer's broadcast moves (every layer-sharded series, coalesced).
        num_layers: ``L``.
        compute_s: one layer's compute time.
        link: the link the broadcasts run on.
        budget_bytes: the most bytes the ring's ``k + 1`` slots may take (None: no limit).
        margin: how much slower than modelled a broadcast may be (0.25: 25%).
        series: names for the error message.

    Raises:
        ValueError: the budget does not hold even ``k = 0``'s single buffer.
    """
    _check_k(layer_bytes, num_layers, compute_s, link, margin, "choose_k")
    if budget_bytes is not None and not (is_finite(budget_bytes) or budget_bytes == math.inf):
        raise ValueError(
            f"choose_k: budget_bytes must be a number of bytes (None or math.inf: no limit), got {budget_bytes!r}"
        )
    top = max(0, num_layers - 1)
    if budget_bytes is not None and budget_bytes < math.inf:
        check_budget(budget_bytes, layer_bytes, series)
        if layer_bytes:
            top = min(top, int(budget_bytes // layer_bytes) - 1)
    if layer_bytes == 0:
        return 0
    latency = (1 + margin) * link.time(layer_bytes)
    if compute_s == 0:
        return top
    return min(top, max(1, math.ceil(latency / compute_s - 1e-9)))


def _check_k(layer_bytes: int, num_layers: int, compute_s: float, link: Link, margin: float, where: str) -> None:
    """One line naming the first input :func:`choose_k` cannot choose from (NaN passes ``<``: each is checked
    finite by name first)."""
    if not isinstance(link, Link):
        raise TypeError(f"{where}: link must be a Link (bytes_per_s, alpha_s), e.g. Link(25e9), got {link!r}")
    for name, value in {"layer_bytes": layer_bytes, "compute_s": compute_s, "margin": margin}.items():
        if not is_finite(value):
            raise ValueError(f"{where}: {name} must be a finite number >= 0, got {value!r}")
    if layer_bytes < 0 or not is_int(num_layers, 1) or compute_s < 0 or margin < 0:
        raise ValueError(
            f"{where}: needs layer_bytes >= 0, num_layers >= 1, compute_s >= 0 and margin >= 0; "
            f"got {layer_bytes}, {num_layers}, {compute_s}, {margin}"
        )


# ---- prefetch_step="auto" on real params --------------------------------------------------------
DEFAULT_DEVICE = {"cpu": "host", "npu": "ascend-910b", "cuda": "h100-sxm"}


def layer_bytes(params: dict) -> int:
    """Bytes one layer's layer-sharded weights move per step (every series, at this rank's shard size)."""
    return _one_layer_bytes(params.get("series") or {})


def _one_layer_bytes(stacked: Any) -> int:
    """Bytes of one layer of a tree of stacked ``[layers, ...]`` tensors."""
    return sum(math.prod(x.shape[1:]) * x.element_size() for x in pytree.tree_leaves(stacked))


def host_step(layer_bytes: int, *, num_layers: int, compute_s: float, link: Link) -> int:
    """The prefetch step for series copied from host memory over ``link`` (``layer_bytes`` per layer, ``compute_s``
    one layer's compute): the smallest ``k`` whose exposed time is within 1% of the least any ``k`` up to the covering
    one (:func:`choose_k`) leaves. Where the link does not keep up with the layers, fetching further ahead absorbs
    latency but not the shortfall, and every slot more is device memory the offload was to free."""
    _check_k(layer_bytes, num_layers, compute_s, link, 0.25, "host_step")
    top = choose_k(layer_bytes, num_layers=num_layers, compute_s=compute_s, link=link)
    occupy, latency = layer_bytes / link.bytes_per_s, link.time(layer_bytes)
    cost = [exposed(num_layers, k, compute_s, occupy, latency) for k in range(top + 1)]
    return next(k for k, c in enumerate(cost) if c <= min(cost) + 0.01)


def host_layer_bytes(params: dict) -> int:
    """Bytes one layer's series kept in host memory move per step (:mod:`.offload`)."""
    return _one_layer_bytes(params.get("host") or {})


def layer_weight_bytes(params: dict) -> int:
    """Bytes of one layer's weights at this rank's shard size (local leaves plus its layer-sharded ones and those
    kept in host memory; a quantized leaf counts every tensor it stores)."""
    layers = params["layers"]
    local = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(layers[0])) if layers else 0
    return local + layer_bytes(params) + host_layer_bytes(params)


def layer_weight_elements(params: dict, quant: Any = None) -> int:
    """Weight values one layer multiplies per token at this rank's shard size: a float leaf's elements, a quantized
    leaf's (stored as ``quant``, a :class:`~functional_npu.core.quant.Quant` or a config holding one) stored values
    times the values packed per element; scales add none."""
    quant = getattr(quant, "quant", quant)

    def values(leaf: Any, per_layer: bool) -> int:
        if isinstance(leaf, dict) and quant is not None and quant.weight_name in leaf:
            t = leaf[quant.weight_name]
            return math.prod(t.shape[per_layer:]) * quant.pack
        return sum(math.prod(t.shape[per_layer:]) for t in pytree.tree_leaves(leaf))

    layers = params["layers"]
    local = sum(values(leaf, False) for leaf in layers[0].values()) if layers else 0
    stacked = (params.get("series") or {}) | (params.get("host") or {})
    return local + sum(values(leaf, True) for leaf in stacked.values())


def auto_step(
    params: dict,
    plan: Plan,
    quant: Quant | None = None,
    *,
    device: Device | str | None = None,
    budget_bytes: float | None = None,
    batch: int = 1,
) -> int:
    """``prefetch_step="auto"`` for layer-sharded ``params`` (loaded for ``plan``, their linears stored as ``quant``:
    a quantization config's ``quant``, or one with a ``.quant``): :func:`choose_k` with one layer's compute from
    ``device``'s roofline (decode at ``batch`` tokens) and its link.

    Raises:
        ValueError: an unknown device name, or a budget that does not hold one layer (see :func:`choose_k`).
    """
    if isinstance(device, str) or device is None:
        name = device or DEFAULT_DEVICE.get(params["embed"].device.type, "host")
        if name not in DEVICES:
            raise ValueError(
                f"prefetch device {name!r} is not known; choose one of {', '.join(DEVICES)} or pass a Device"
            )
        device = DEVICES[name]
    compute = roofline_layer_s(device, layer_weight_bytes(params), 2.0 * batch * layer_weight_elements(params, quant))
    L, host = params.config.num_layers, host_layer_bytes(params)
    if host and not params.get("series"):  # host series alone: copied over the device's host link, if it has one
        link = device.host_link
        k = host_step(host, num_layers=L, compute_s=compute, link=link) if link else min(1, L - 1)
        if budget_bytes is None or budget_bytes == math.inf:
            return k
        check_budget(budget_bytes, host, ",".join(plan.offload) or "the series in host memory")
        return min(k, int(budget_bytes // host) - 1)  # the ring's k + 1 slots within the budget
    return choose_k(
        layer_bytes(params),
        num_layers=L,
        compute_s=compute,
        link=device.link,
        budget_bytes=budget_bytes,
        series=",".join(plan.layer_shard.leaves) if plan.layer_shard else "the layer-sharded series",
    )
