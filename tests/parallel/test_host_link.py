"""The emulated host link (:class:`functional_npu.parallel.host_link.EmulatedHostLink`): a transfer completes no
sooner than the link could carry it, transfers queue behind each other, a ring slot copied through it holds the host
bytes once waited, and the bad inputs. The compiled model on a link is in ``test_offload.py``.

Every timing here is a lower bound the link promises (a completion before its due time is a bug whatever the load),
never a limit on how fast anything runs."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed._functional_collectives as funcol

from functional_npu.core.collectives import copy_into
from functional_npu.parallel import EmulatedHostLink
from functional_npu.parallel.host_link import check_host_link


def test_transfers_complete_after_their_time_one_after_another():
    x = torch.zeros(2500)  # 10 kB: 10 ms at 1 MB/s, plus 20 ms of latency
    with EmulatedHostLink(1e6, 0.02) as link:
        assert link.transfer_s(x.numel() * 4) == pytest.approx(0.03)
        t0 = time.perf_counter()
        first, second = link.broadcast([x]), link.broadcast([x])
        first.wait()
        t1 = time.perf_counter()
        second.wait()
        t2 = time.perf_counter()
    assert t1 - t0 >= 0.03 and t2 - t0 >= 0.06  # the second waited for the link, then took its own time
    assert link.carried["transfers"] == 2 and link.carried["bytes"] == 20_000 and link.carried["late_s"] >= 0
    assert link.name  # kept after exit, and unregistered: a later link gets another name
    with EmulatedHostLink(1e9) as again:
        assert again.name != link.name


def test_a_slot_copied_through_the_link_holds_the_host_bytes_once_waited():
    parts = [torch.arange(6.0).view(2, 3), torch.full((4,), 7.0)]
    slot = torch.zeros(10)
    with EmulatedHostLink(1e6, 0.02) as link:
        t0 = time.perf_counter()
        out = funcol.wait_tensor(copy_into(slot, parts, None, link.name))
        waited = time.perf_counter() - t0
    assert waited >= link.transfer_s(40)
    assert torch.equal(out, torch.cat([parts[0].reshape(-1), parts[1]])) and out.data_ptr() == slot.data_ptr()
    assert link.carried["transfers"] == 1 and link.carried["bytes"] == 40


FIX = "e.g. EmulatedHostLink(25e9, 2e-6) for 25 GB/s, 2 us"


@pytest.mark.parametrize(
    "args, message",
    [
        ((0,), "bytes_per_s=0 is outside [1000, inf]"),
        ((1e-300,), "bytes_per_s=1e-300 is outside [1000, inf]"),  # its completion once overflowed the clock: a hang
        ((float("nan"),), "bytes_per_s=nan is outside [1000, inf]"),
        ((float("inf"),), "bytes_per_s=inf is outside [1000, inf]"),
        ((10**400,), f"bytes_per_s={10**400!r} is outside [1000, inf]"),
        ((True,), "bytes_per_s must be a number, got True (bool)"),
        (("25e9",), "bytes_per_s must be a number, got '25e9' (str)"),
        ((None,), "bytes_per_s must be a number, got None (NoneType)"),
        ((1e9, -1.0), "latency_s=-1.0 is outside [0, 10]"),
        ((1e9, float("inf")), "latency_s=inf is outside [0, 10]"),
        ((1e9, 1e300), "latency_s=1e+300 is outside [0, 10]"),
    ],
)
def test_a_link_figure_out_of_range_is_refused_in_one_line(args, message):
    with pytest.raises(ValueError) as e:
        EmulatedHostLink(*args)
    assert str(e.value) == f"EmulatedHostLink: {message}; {FIX}"


class _Failing(EmulatedHostLink):
    def _carry(self) -> None:
        raise OverflowError("timestamp out of range for platform time_t")


def test_the_link_thread_failing_is_raised_in_the_caller_and_nothing_waits_forever():
    """The thread once died on an OverflowError and the generate waiting on it never returned: what it held completes,
    and its failure is raised by the next transfer and by ``check`` (the compiled model's, after each step)."""
    with _Failing(1e6) as link:
        link._thread.join(timeout=10)
        failed = rf"EmulatedHostLink '{link.name}': its thread failed: OverflowError"
        with pytest.raises(RuntimeError, match=failed):
            link.broadcast([torch.zeros(4)])
        with pytest.raises(RuntimeError, match=failed):
            link.check()


def test_bad_links_are_refused_with_the_fix():
    host = {"host": {"o_proj": torch.zeros(2, 2, 2)}}
    with pytest.raises(ValueError, match=r"^compile_model: host_link=.* is not an entered EmulatedHostLink; use"):
        check_host_link(host, EmulatedHostLink(1e9), "cpu", None, "compile_model")
    with EmulatedHostLink(1e9) as link:
        with pytest.raises(ValueError, match=r"these params are on 'cuda', whose copies from host memory are real"):
            check_host_link(host, link, "cuda", None, "compile_model")
        with pytest.raises(ValueError, match=r"no series is kept in host memory: plan.offload is empty"):
            check_host_link({}, link, "cpu", None, "compile_model")
        with pytest.raises(ValueError, match=r"host_link with cache_dir='/tmp/g': the graphs name this process's link"):
            check_host_link(host, link, "cpu", "/tmp/g", "compile_model")
        check_host_link(host, link, "cpu", None, "compile_model")
    with pytest.raises(RuntimeError, match=r"a transfer on a link that is not entered"):
        link.broadcast([torch.zeros(1)])
    with pytest.raises(ValueError, match=r"is not an entered EmulatedHostLink"):  # after its with block
        check_host_link(host, link, "cpu", None, "compile_model")
