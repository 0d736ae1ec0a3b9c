"""An emulated host link: host-memory copies delivered at a stated bandwidth and latency, on a CPU host.

A CPU host has no copy engine and one memory, so a ring slot filled from "host memory" there is a memcpy that
lands at once. :class:`EmulatedHostLink` gives such copies a device's link timing, as the emulated interconnect
(a shaped loopback in a private network namespace, ``benchmarks/shaped_link.py``) gives the broadcasts theirs:
``compile_model(..., host_link=link)`` makes each host copy of the ring (:func:`functional_npu.core.collectives
.copy_into`) hand its filled slot to this one-rank c10d process group, whose broadcast completes only once the link
would have carried the bytes. Transfers are serialized, first issued first carried: one that starts when the link is
free, at time ``t``, completes at ``t + latency_s + bytes / bytes_per_s``. The graph's ``wait_tensor`` of the slot
waits for that completion, so whatever the step computes between a copy's issue and its first use hides its time,
and what is left is the exposed copy time the prefetch step ``k`` is meant to absorb.

The bytes themselves are copied when the copy is issued, by the cores that compute (the memcpy a CPU host pays
whatever the link); only their delivery is delayed. The link is a context manager: entering registers the group
under a fresh name and starts the thread that completes transfers; leaving stops the thread and unregisters the
name. It is for benchmarks and tests of the prefetch ring's overlap on a CPU host; a device's copies are real.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    _create_work_from_future,
    _register_process_group,
    _unregister_process_group,
)

from .offload import host_of

__all__ = ["EmulatedHostLink", "check_host_link", "MIN_BYTES_PER_S", "MAX_LATENCY_S"]

# the slowest link and the longest latency emulated: past them a step's copies would outlast any benchmark (a
# 1e-300 B/s link's completion time once overflowed the platform's clock and hung the generate waiting on it)
MIN_BYTES_PER_S = 1e3
MAX_LATENCY_S = 10.0


def _figure(name: str, value: Any, low: float, high: float, example: str) -> float:
    """``value`` as a float in ``[low, high]``; anything else (a bool, a string, None, NaN, inf, an int past float
    range) one line naming the field, the value and the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"EmulatedHostLink: {name} must be a number, got {value!r} ({type(value).__name__}); {example}"
        )
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not (math.isfinite(x) and low <= x <= high):
        raise ValueError(f"EmulatedHostLink: {name}={value!r} is outside [{low:g}, {high:g}]; {example}")
    return x


class EmulatedHostLink(dist.ProcessGroup):
    """A one-rank process group whose ``broadcast`` is a transfer over a link of ``bytes_per_s`` and ``latency_s``
    (see the module docstring). ``name`` is its registered group name while entered; ``carried`` counts the
    transfers and bytes it has accepted, and the seconds its completions came after their due times in all (the
    thread's wake-up, on a core the step may be using).

    A transfer's work completes at its due time (finite: the figures are bounded). If the link's thread fails, what it
    holds completes at once and the failure is raised in the caller, naming the link: by every later transfer and by
    :meth:`check`, which the compiled model calls after each step.

    Raises:
        ValueError: a bandwidth or latency that is not a finite number in range (:data:`MIN_BYTES_PER_S` and up;
            ``0 <= latency_s <=`` :data:`MAX_LATENCY_S`).
    """

    def __init__(self, bytes_per_s: float, latency_s: float = 0.0):
        example = "e.g. EmulatedHostLink(25e9, 2e-6) for 25 GB/s, 2 us"
        bandwidth = _figure("bytes_per_s", bytes_per_s, MIN_BYTES_PER_S, math.inf, example)
        latency = _figure("latency_s", latency_s, 0.0, MAX_LATENCY_S, example)
        super().__init__(0, 1)
        self.bytes_per_s = bandwidth
        self.latency_s = latency
        self.name = ""
        self.carried = {"transfers": 0, "bytes": 0, "late_s": 0.0}
        self._free_at = 0.0  # when the link finishes its last accepted transfer
        self._due: list[tuple[float, int, torch.futures.Future, list[torch.Tensor]]] = []  # (time, order, ...)
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._error: BaseException | None = None

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return "emulated-host-link"

    @property
    def entered(self) -> bool:
        """Whether the link is inside its ``with`` block (its group registered, its thread running)."""
        return self._thread is not None

    def __enter__(self) -> EmulatedHostLink:
        if self._thread is not None:
            raise RuntimeError(f"EmulatedHostLink {self.name!r} is already entered")
        self.name = f"functional_npu.emulated_host_link.{id(self):x}"  # unique among the links alive
        self._closing = False
        self._error = None
        self._thread = threading.Thread(target=self._complete, name=self.name, daemon=True)
        self._thread.start()
        _register_process_group(self.name, self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
        _unregister_process_group(self.name)
        self._thread = None

    def transfer_s(self, nbytes: int) -> float:
        """Seconds the link takes to carry ``nbytes`` once it is free."""
        return self.latency_s + nbytes / self.bytes_per_s

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """Accept a transfer of ``tensors``' bytes (already in place); the returned work completes when the link
        would have carried them."""
        if self._thread is None:
            raise RuntimeError("EmulatedHostLink: a transfer on a link that is not entered (use it as `with link:`)")
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if self._error is not None:
            raise self._failure()
        fut: torch.futures.Future = torch.futures.Future()
        with self._cv:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + self.transfer_s(nbytes)
            heapq.heappush(self._due, (self._free_at, self.carried["transfers"], fut, tensors))
            self.carried["transfers"] += 1
            self.carried["bytes"] += nbytes
            self._cv.notify()
        return _create_work_from_future(fut)

    def _failure(self) -> RuntimeError:
        return RuntimeError(f"EmulatedHostLink {self.name!r}: its thread failed: {self._error!r}")

    def check(self) -> None:
        """Raise the link thread's failure, if it failed (the compiled model calls this after each step)."""
        if self._error is not None:
            raise self._failure()

    def _complete(self) -> None:
        """The link's thread (:meth:`_carry`). On a failure every transfer it holds completes at once (c10d's work
        from a future does not carry an error to its wait, and the bytes are in place since the transfer's issue):
        nothing waits forever; the failure is raised by every later transfer and by :meth:`check`."""
        try:
            self._carry()
        except BaseException as e:  # noqa: BLE001 - raised in the caller, never lost in this thread
            with self._cv:
                self._error = e
                pending, self._due = self._due, []
            for _, _, fut, tensors in pending:
                if not fut.done():
                    fut.set_result(tensors)

    def _carry(self) -> None:
        """Completes each accepted transfer at its time, in order; at exit, the rest at once."""
        while True:
            with self._cv:
                while not self._due and not self._closing:
                    self._cv.wait()
                if not self._due:
                    return
                due, _, fut, tensors = self._due[0]
                wait = due - time.perf_counter()
                if wait > 0 and not self._closing:
                    self._cv.wait(timeout=wait)
                    continue
                heapq.heappop(self._due)
            fut.set_result(tensors)
            self.carried["late_s"] += max(0.0, time.perf_counter() - due)


def check_host_link(
    params: dict[str, Any], link: EmulatedHostLink | None, device: str, cache_dir: Any, where: str
) -> None:
    """Refuse a host link that cannot apply: not an entered :class:`EmulatedHostLink`, params off the CPU (a
    device's copies are real), a model with no series in host memory, or a graph directory (the graphs name it)."""
    if link is None:
        return
    if not isinstance(link, EmulatedHostLink) or not link.entered:
        raise ValueError(
            f"{where}: host_link={link!r} is not an entered EmulatedHostLink; use `with EmulatedHostLink(bytes_per_s, "
            f"latency_s) as link:` and pass host_link=link inside it"
        )
    if device != "cpu":
        raise ValueError(
            f"{where}: host_link emulates a host link on a CPU host, and these params are on {device!r}, whose "
            f"copies from host memory are real; drop host_link"
        )
    if not host_of(params):
        raise ValueError(
            f"{where}: host_link is given, and no series is kept in host memory: plan.offload is empty; name the "
            f"series to offload (e.g. Plan(offload='o_proj,down')) or drop host_link"
        )
    if cache_dir is not None:
        raise ValueError(
            f"{where}: host_link with cache_dir={str(cache_dir)!r}: the graphs name this process's link, so they "
            f"cannot be saved for another; drop one of the two"
        )
