"""This machine as a device profile, measured on first use and cached: what the planner models a CPU run with.

:func:`host_device` starts ``world`` local gloo ranks (the shape of the run being planned), at most
:data:`MEASURED_RANKS` (a profile asked for more ranks than that is measured with that many and the larger groups'
collectives follow its link, :meth:`~functional_npu.parallel.devices.Device.collective_s`: starting one process per
planned device would exhaust the machine), and measures, with every rank busy at once as in a real step:

- the rate one rank's decode linears stream their weights at (a few rows through 64 MiB of fp32 weights):
  the profile's memory bandwidth, what a decode step's kernels reach here (a plain read, also recorded, is
  about twice that on this project's host);
- the FLOP/s one rank gets (a square fp32 matmul);
- every collective the model runs (:data:`~functional_npu.parallel.devices.COLLECTIVES`, through this
  library's own :mod:`~functional_npu.core.collectives`) over every group size dividing ``world``, at a
  small and a large payload, each after a layer's worth of compute as in a step (its cost is what it adds to
  that compute: ranks sharing cores reach a collective at different times, which calls back to back hide):
  ``alpha`` is the small call's cost, the per-byte time the slope between them.

The profile says communication does not overlap compute (``overlap=False``): the ranks fill the cores, and
gloo's transfers take turns with their compute. The profile is written atomically to
``$FUNCTIONAL_NPU_CACHE/host-profile/`` (default ``~/.cache/functional_npu``), keyed by the host, its cores,
torch's version and ``world``; a file that does not parse or does not carry every figure is measured again,
never trusted.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ...core.cache_dir import cache_dir, cache_problem
from ...core.files import write_bytes
from ...parallel.devices import COLLECTIVES, DEVICES, Device, Link

__all__ = ["host_device", "measure", "profile_path"]

VERSION = 3
MEASURED_RANKS = 4  # the most local ranks a profile starts (the cores are shared: more measure nothing new)
log = logging.getLogger("functional_npu")
SMALL, LARGE = 4096, 4 * 2**20  # payload bytes of the two calls each collective is timed at


def profile_path(world: int) -> Path:
    """Where the profile of this machine at ``world`` ranks is cached."""
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in platform.node() or "host")
    name = f"{host}-{os.cpu_count()}cpu-torch{torch.__version__.split('+')[0]}-world{world}.json"
    return cache_dir() / "host-profile" / name


def _timed(fn: Any, repeat: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _call(kind: str, mesh: Any, axis: str, payload: int) -> Any:
    """A function running one ``kind`` collective of ``payload`` bytes over ``axis`` and waiting for it."""
    import torch.distributed._functional_collectives as funcol

    from ...core import collectives as c

    n = mesh.axis_size(axis)
    elements = max(n, payload // 4 // n * n)
    x = torch.ones(elements)
    part = torch.ones(elements // n)  # an all-gather's input: its payload is the gathered result
    run = {
        "all_reduce": lambda: c.all_reduce(x, mesh, axis),
        "all_gather": lambda: c.all_gather(part, mesh, axis),
        "reduce_scatter": lambda: c.reduce_scatter(x, mesh, axis),
        "all_to_all": lambda: c.all_to_all_single(x, mesh, axis),
        "broadcast": lambda: c.broadcast(x, mesh, axis),
    }[kind]
    return lambda: funcol.wait_tensor(run())


def measure_on_rank(ctx: Any, world: int, repeat: int) -> dict[str, Any]:
    """One rank's share of :func:`measure` (every rank runs it; the figures are rank 0's, taken while every
    rank does the same)."""
    import torch.distributed as dist

    dist.barrier()
    out = _roofline(repeat)
    # each collective runs after a layer's worth of compute, as in a step: what it adds to the compute alone is
    # its cost there (ranks that share cores reach it at different times, which a back-to-back loop hides)
    weights, rows = [torch.randn(1536, 512) for _ in range(2)], torch.randn(2, 512)

    def layer() -> None:
        for w in weights:
            rows @ w.T

    dist.barrier()
    alone = _timed(layer, repeat)
    measured = {}
    for n in [d for d in range(2, world + 1) if world % d == 0]:
        mesh = ctx.mesh({"outer": world // n, "inner": n})
        for kind in COLLECTIVES:
            times = []
            for payload in (SMALL, LARGE):
                fn = _call(kind, mesh, "inner", payload)
                dist.barrier()
                times.append(max(0.0, _timed(lambda f=fn: (layer(), f()), repeat) - alone))
            alpha = times[0]
            per_byte = max(0.0, (times[1] - times[0]) / (LARGE - SMALL))
            measured[f"{kind}/{n}"] = (alpha, per_byte)
    out["measured"] = measured
    return out


def measure(world: int, *, repeat: int = 25) -> Device:
    """Measure this machine with ``world`` local ranks (see the module docstring); nothing cached."""
    return _device(_figures(world, repeat), world)


def _roofline(repeat: int) -> dict[str, Any]:
    """This rank's rates: a plain read, the rate decode's linears stream their weights at (a few rows through
    64 MiB of ``[1536, 512]`` fp32 weights, the size of a small model's), and a matmul's FLOP/s."""
    x = torch.ones(64 * 2**18)
    weights = [torch.randn(1536, 512) for _ in range(64 * 2**20 // (1536 * 512 * 4))]
    rows = torch.randn(2, 512)
    a = torch.randn(512, 512)
    return {
        "read_bytes_per_s": x.numel() * 4 / _timed(x.sum, repeat),
        "linear_bytes_per_s": sum(w.nbytes for w in weights) / _timed(lambda: [rows @ w.T for w in weights], repeat),
        "flop_per_s": 2 * 512**3 / _timed(lambda: a @ a, repeat),
        "measured": {},
    }


def _figures(world: int, repeat: int) -> dict[str, Any]:
    if world == 1:  # nothing to exchange: the roofline alone, in this process
        return _roofline(repeat)
    from ..launch import LocalWorld

    try:
        with LocalWorld(world, timeout=300.0) as w:
            return w.run(measure_on_rank, world, repeat)[0]
    except Exception as e:  # noqa: BLE001 - a rank's failure, a timeout: one line, not the ranks' tracebacks
        first = " ".join(str(e).split("\n")[0].split())[:200]
        raise RuntimeError(f"host profile: measuring this machine with {world} local ranks failed ({first})") from None


def _device(figures: dict[str, Any], world: int) -> Device:
    measured = {k: (float(a), float(b)) for k, (a, b) in figures["measured"].items()}
    bcast = measured.get(f"broadcast/{world}") or (1e-4, 1e-9)
    return Device(
        "host",
        memory_bytes_per_s=float(figures["linear_bytes_per_s"]),  # what a decode step's kernels stream at
        flop_per_s=float(figures["flop_per_s"]),
        link=Link(bytes_per_s=1 / max(bcast[1], 1e-12), alpha_s=bcast[0]),
        source=f"measured on {platform.node() or 'this host'} with {world} local gloo ranks "
        f"({os.cpu_count()} cores, torch {torch.__version__})",
        measured=measured,
        measured_world=world,
        overlap=False,  # the ranks' compute fills the cores: gloo's transfers take turns with it
        step_overhead_s=DEVICES["host"].step_overhead_s,  # the library's own compiled runs' fixed cost per step
    )


def _read(path: Path, world: int) -> Device | None:
    """The cached profile, or None for a missing, unparsable, stale or incomplete file."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION or data.get("world") != world:
            return None
        wanted = {f"{k}/{n}" for k in COLLECTIVES for n in range(2, world + 1) if world % n == 0}
        figures = data["figures"]
        rates = (figures["read_bytes_per_s"], figures["linear_bytes_per_s"], figures["flop_per_s"])
        if not wanted <= set(figures["measured"]) or min(rates) <= 0:
            return None
        return _device(figures, world)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def host_device(world: int, *, refresh: bool = False, repeat: int = 25) -> Device:
    """This machine's profile at ``world`` ranks (measured with at most :data:`MEASURED_RANKS` of them): cached,
    else measured now (tens of seconds) and cached.

    Raises:
        ValueError for a world that is not a positive int; RuntimeError (one line) when a measuring rank fails.
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"host profile: world must be a positive int, got {world!r}")
    world = min(world, MEASURED_RANKS)
    path = profile_path(world)
    cached = None if refresh else _read(path, world)
    if cached is not None:
        return cached
    problem = cache_problem(path.parent)  # known before measuring: the figures are used, not kept
    figures = _figures(world, repeat)
    if problem is not None:
        log.warning("host profile: measured, not cached: %s", problem)
        return _device(figures, world)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, json.dumps({"version": VERSION, "world": world, "figures": figures}).encode())
    except OSError as e:  # a full disk: measured, not cached
        log.warning("host profile: measured, not cached: %s writing %s", e.strerror or e, path)
    return _device(figures, world)
