"""A ring slot's host copy on a GPU's side stream (:mod:`functional_npu.core.side_copy`), run on the CPU with only the
device's stream module stood in: a recording module whose streams and events log what the copy issues, and a
dispatch mode that logs each copy with the stream current when it ran.

The order is the claim: the side stream waits for an event of the compute stream recorded when the op is called,
the copies run on the side stream (not the compute stream), a second event follows them there, and the compute
stream waits for it only where the slot is first waited (``wait_tensor``), once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from torch.utils._python_dispatch import TorchDispatchMode

from functional_npu.core.side_copy import EventWork, side_copy, side_stream_api

from ..support.standin_streams import Device as _Device
from ..support.standin_streams import Stream as _Stream


class _Copies(TorchDispatchMode):
    """Logs each ``copy_`` with the stand-in's current stream and the elements copied."""

    def __init__(self, api: _Device) -> None:
        super().__init__()
        self.api = api

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.api.log.append(("copy", self.api.current.name, args[1].numel()))
        return func(*args, **(kwargs or {}))


def _parts() -> list[torch.Tensor]:
    return [torch.arange(6.0).reshape(2, 3), torch.arange(10.0, 14.0)]


def test_the_copies_run_on_a_side_stream_between_the_fork_and_the_join():
    api, slot = _Device(), torch.zeros(10)
    with _Copies(api):
        side_copy(slot, _parts(), api)
    assert torch.equal(slot, torch.cat([p.reshape(-1) for p in _parts()]))
    assert api.log == [
        ("record", "main", "e0"),  # after everything the compute stream has issued (the slot's last reads)
        ("wait", "side1", "e0"),
        ("copy", "side1", 6),
        ("copy", "side1", 4),
        ("record", "side1", "e1"),
    ]  # and nothing waits on the compute stream yet: it runs on beside the copies
    funcol.wait_tensor(slot)  # the slot's first use
    assert api.log[-1] == ("wait", "main", "e1")
    funcol.wait_tensor(slot)  # waited once: the work is taken off the registry
    assert len(api.log) == 6


def test_without_a_stream_module_the_copies_run_on_the_current_stream():
    """``api`` None (the CPU, the NPU, a local source): the same copies, no event, no pending work."""
    slot = torch.zeros(10)
    with _Copies(_Device()) as mode:
        side_copy(slot, _parts(), None)
    assert torch.equal(slot, torch.cat([p.reshape(-1) for p in _parts()]))
    assert mode.api.log == [("copy", "main", 6), ("copy", "main", 4)]


def test_a_copy_on_the_compute_stream_is_seen():
    """The counterexample: a device whose "side" stream is the compute stream puts the copies on it, and the log
    shows it (the first test's check of the copies' stream fails here)."""
    api, slot = _Device(reuse_main=True), torch.zeros(10)
    with _Copies(api):
        side_copy(slot, _parts(), api)
    funcol.wait_tensor(slot)
    assert [x[1] for x in api.log if x[0] == "copy"] == ["main", "main"]


def test_the_work_waits_on_the_calling_stream_and_reports_the_event():
    api = _Device()
    done = api.Event()
    work = EventWork(done, api, torch.device("cpu"))
    assert not work.is_completed()
    done.record(api.main)
    assert work.is_completed()
    with api.stream(_Stream(api, "other")):
        assert work.wait() is True
    assert api.log[-1] == ("wait", "other", done.name)


@pytest.mark.parametrize(
    ("slot", "parts", "side"),
    [
        ("cuda:0", ["cpu", "cpu"], True),  # host copies on a GPU: a side stream
        ("cuda:0", ["cpu", "cuda:0"], True),
        ("cuda:0", ["cuda:0"], False),  # a local cat: the compute stream
        ("cuda:0", [], False),  # not the source of a broadcast: nothing to copy
        ("cpu", ["cpu"], False),  # one stream
        ("xpu:0", ["cpu"], False),  # off SIDE_STREAM_DEVICES (the NPU's compilers place it on their prefetch stream)
    ],
)
def test_which_copies_take_a_side_stream(slot, parts, side):
    api = side_stream_api(torch.device(slot), [torch.device(p) for p in parts])
    assert (api is torch.cuda) if side else api is None
