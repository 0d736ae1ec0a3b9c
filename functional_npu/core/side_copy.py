"""Host-to-device copies on a side stream, ordered by events: a ring slot filled from host memory on a GPU overlaps
the work the compute stream runs meanwhile, instead of queueing behind it.

``functional_npu::broadcast_into`` (:mod:`.collectives`) runs :func:`side_copy` for a slot on a device of
:data:`SIDE_STREAM_DEVICES` whose parts lie in host memory:

1. an event is recorded on the current (compute) stream. The ring calls the op once its ``after`` exists (the
   residual stream entering the layer after the slot's previous occupant), so that event follows every kernel that
   reads the slot's previous contents;
2. a side stream waits for that event, copies each part into its span of the slot (asynchronous: the parts are
   pinned), and records a second event;
3. the slot gets a pending c10d work, as a collective's output does: ``wait_tensor(slot)`` (in a compiled graph the
   slot's first use) makes the stream that calls it wait for the second event, and returns at once on the host.

Between 1 and 3 the compute stream runs whatever the graph issues, beside the copy. Under stream capture (a CUDA graph
around the step) the two events are the fork and the join of the captured side branch. On the NPU the graph
compilers place the copy on their own prefetch stream (npugraph_ex's stream scope and tagged events,
:mod:`functional_npu.parallel.streams`), so nothing is done here; on the CPU there is one stream and nothing to order.

``api`` is the device's module (``torch.cuda``): its ``current_stream``, ``Stream``, ``Event`` and ``stream``. A
test stands a recording module in for the device and runs these lines on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_work

__all__ = ["SIDE_STREAM_DEVICES", "side_stream_api", "side_copy", "EventWork"]

SIDE_STREAM_DEVICES = ("cuda",)  # where the op itself puts host copies on a side stream (see the module docstring)


def side_stream_api(slot: torch.device, parts: Sequence[torch.device]) -> Any | None:
    """The device module whose streams a copy of ``parts`` into a slot on device ``slot`` runs on (``torch.cuda``), or
    None where the copy runs on the current stream: a slot off :data:`SIDE_STREAM_DEVICES`, or parts already on the
    slot's device (a local ``cat``, not a host copy)."""
    if slot.type not in SIDE_STREAM_DEVICES or not parts or all(p == slot for p in parts):
        return None
    return torch.get_device_module(slot.type)


class EventWork(dist.Work):
    """A slot's pending copy, as c10d's registry holds a collective's: :meth:`wait` makes the calling stream wait for
    ``done`` (recorded after the copies on the side stream) and returns at once on the host."""

    def __init__(self, done: Any, api: Any, device: torch.device) -> None:
        super().__init__()
        self.done, self.api, self.device = done, api, device

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.api.current_stream(self.device).wait_event(self.done)
        return True

    def is_completed(self) -> bool:
        return bool(self.done.query())


def side_copy(slot: torch.Tensor, parts: Sequence[torch.Tensor], api: Any | None) -> None:
    """``slot <- cat(parts)``, one asynchronous copy per part: on a side stream of ``api``'s device, after the work
    issued so far on the current stream, with the slot's pending work registered for ``wait_tensor`` (the module
    docstring's steps 1-3); on the current stream where ``api`` is None (:func:`side_stream_api`'s answer)."""
    if api is None:
        _copy_parts(slot, parts)
        return
    main = api.current_stream(slot.device)
    issued = api.Event()
    issued.record(main)
    side = api.Stream(device=slot.device)
    side.wait_event(issued)
    with api.stream(side):
        _copy_parts(slot, parts)
        done = api.Event()
        done.record(side)
    _register_work(slot, EventWork(done, api, slot.device))


def _copy_parts(slot: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Each part into its span of ``slot`` on the current stream, asynchronous from pinned memory."""
    for part, view in zip(parts, slot.split([p.numel() for p in parts])):
        view.copy_(part.reshape(-1), non_blocking=True)
