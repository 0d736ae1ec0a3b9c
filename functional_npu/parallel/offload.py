"""Series kept in host memory: the prefetch ring's second source.

A plan's ``offload`` names per-layer series (``o_proj``, ``down``, ``layer``: the names ``layer_shard`` takes) that
live whole, every layer, in host memory on each rank, pinned where the params' device has pinned memory, under
``params["host"][leaf]`` as one stacked ``[L, ...]`` tensor whose dim 0 is whole (layout ``(None, *per-layer)``) and
whose other dims keep the per-layer (tensor-parallel) layout. The per-layer dicts no longer hold the leaf, as for a
layer-sharded series.

The forward fetches them through the same ring as layer-sharded series (:mod:`.prefetch`): ``k + 1`` slots owned
outside the graph, layer ``l + k`` written in place while layer ``l`` computes, each write ordered after every read of
the slot's previous layer, under the same events. A host series' write is a copy from host memory
(:func:`functional_npu.core.collectives.copy_into`), the same graph op as a broadcast into a slot with a group of
one, so the hazard check, the capture checks and the golden graphs cover both sources alike. A plan may mix them:
some series layer-sharded (filled by a peer's broadcast), others offloaded (filled from host memory).

Everything here is pure but :func:`pinned`, which copies into page-locked memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..core.layout import Layout
from ..core.params import drop
from .layer_shard import series_names

__all__ = [
    "offload_names",
    "check_no_host_series",
    "host_of",
    "host_specs",
    "stack_host",
    "unstack_host",
    "check_sources",
    "pinned",
    "check_host_backend",
    "host_bytes",
    "available_host_bytes",
    "check_host_memory",
]


def offload_names(value: Any) -> tuple[str, ...]:
    """``Plan.offload`` as a tuple of series names from ``"o_proj,down"``, a list, or ``()``.

    Raises:
        ValueError for a name that is not an identifier.
    """
    return () if value is None else series_names(value, "Plan.offload", empty=True)


def check_no_host_series(params: dict[str, Any], where: str) -> None:
    """Refuse the differentiable forward (a gradient step, training's log-probs) over params that keep series in
    host memory (a serving plan), naming them."""
    if host_of(params):
        raise ValueError(
            f"{where}: series {list(host_of(params))} are kept in host memory (plan.offload), a serving plan; a "
            f"gradient step needs its weights on the device (and so does {where}'s differentiable forward): use "
            f"params loaded without offload (reshard_params moves them between the two plans)"
        )


def host_of(params: dict[str, Any]) -> dict[str, Any]:
    """The series kept in host memory, ``{leaf: stacked [L, ...]}`` (empty when none)."""
    return params.get("host") or {}


def check_sources(layer_shard: Sequence[str], offload: Sequence[str], where: str = "plan") -> None:
    """A series comes from one source: refuse one both layer-sharded and offloaded (resolved leaf names)."""
    both = [leaf for leaf in offload if leaf in layer_shard]
    if both:
        raise ValueError(
            f"{where}: series {both} are both layer-sharded (plan.layer_shard) and kept in host memory "
            f"(plan.offload); a series has one source: drop it from one of the two"
        )


def host_specs(specs: dict[str, Any], leaves: Sequence[str], num_layers: int) -> dict[str, Any]:
    """A family's spec tree with the ``leaves`` moved to stacked leaves under ``specs["host"]``, dim 0 whole."""
    layer = specs["layers"][0]

    def stacked(lay: Layout) -> Layout:
        return Layout((None,) + lay.dims)

    host = {leaf: pytree.tree_map(stacked, layer[leaf]) for leaf in leaves}
    rest = [{k: v for k, v in spec.items() if k not in leaves} for spec in specs["layers"]]
    return specs | {"layers": rest, "host": host}


def stack_host(params: dict[str, Any], leaves: Sequence[str]) -> dict[str, Any]:
    """Params with the ``leaves`` of every layer stacked ``[L, ...]`` under ``params["host"]``. Pure (the stacked
    tensors are new; :func:`pinned` moves them to host memory)."""
    layers = params["layers"]
    host = {leaf: pytree.tree_map(lambda *xs: torch.stack(xs), *[layer[leaf] for layer in layers]) for leaf in leaves}
    rest = [{k: v for k, v in layer.items() if k not in leaves} for layer in layers]
    return params | {"layers": rest, "host": host}


def unstack_host(params: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`stack_host`: each layer's slice of the host series back in its layer (on the device of
    the layer's other leaves). Pure."""
    if "host" not in params:
        return params
    host, layers = params["host"], params["layers"]
    device = next((x.device for x in pytree.tree_leaves(layers) if isinstance(x, torch.Tensor)), None)
    out = [
        layer
        | {leaf: pytree.tree_map(lambda x, i=i: x[i].to(device or x.device, copy=True), host[leaf]) for leaf in host}
        for i, layer in enumerate(layers)
    ]
    return drop(params, "host") | {"layers": out}


def host_bytes(params: dict[str, Any]) -> int:
    """Bytes of the series kept in host memory."""
    return sum(x.numel() * x.element_size() for x in pytree.tree_leaves(host_of(params)) if isinstance(x, torch.Tensor))


def available_host_bytes() -> int | None:
    """The host memory available now (``MemAvailable`` of ``/proc/meminfo``); None where it cannot be known."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(nbytes: int, where: str, available: int | None = None) -> None:
    """Refuse, before anything is read, series that would not fit the host memory available (``available``, default
    :func:`available_host_bytes`; nothing is checked where it cannot be known)."""
    available = available_host_bytes() if available is None else available
    if available is not None and nbytes > available:
        raise ValueError(
            f"{where}: the offloaded series take {_bytes(nbytes)} of host memory, and {_bytes(available)} is "
            f"available; offload fewer series (plan.offload), or shard them over more ranks (plan.tp)"
        )


def _bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps a figure of at least 1 (a tiny model's series once read
    "0.00 GiB of 0.00 GiB")."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} bytes"


def pinned(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` in host memory: page-locked where ``device`` is an accelerator with pinned memory (so a copy from it is
    asynchronous and a captured graph can hold it), plain host memory on a CPU."""
    x = x.to("cpu")
    if device.type != "cpu" and torch.accelerator.is_available():
        return x.pin_memory()
    return x


# where a host-to-device copy is an op ordered inside the step: inductor without CUDA graphs (an op of the graph; with
# the library's own graph around each step where CUDA graphs were asked for: compile_model's library_graphs), the
# eager backends, npugraph_ex's ACL graph (a captured copy from pinned memory on the prefetch stream, under the ring's
# events); refused elsewhere, with why
def _refusal(backend: str, mode: str | None, captures: bool, device: str) -> str | None:
    if backend == "torchair" and mode == "reduce-overhead":
        return "torchair's captured mode is not checked with copies from host memory (npugraph_ex's ACL graph is)"
    if backend == "torchair":
        return (
            "torchair takes a graph's host tensors as host-placed inputs of the whole GE graph, moved before it runs, "
            "not as copies the ring orders inside the step"
        )
    if backend == "inductor" and captures and device == "cuda":  # compile_model captures the steps itself instead
        return "inductor's CUDA graphs skip (do not capture) a graph with host tensor inputs"
    return None


def check_host_backend(
    params: dict[str, Any], backend: str, mode: str | None, captures: bool, device: str, where: str
) -> None:
    """Refuse host series on a backend that cannot copy them into the ring inside a step, naming it and why."""
    if not host_of(params):
        return
    why = _refusal(backend, mode, captures, device)
    if why is not None:
        raise ValueError(
            f"{where}: series {list(host_of(params))} are kept in host memory (plan.offload), and backend "
            f"{backend!r} cannot copy them into the ring within a step: {why}; use backend 'npugraph_ex' on an NPU, "
            f"mode='default' with inductor on a GPU, or keep the series on the device (plan.offload=())"
        )
