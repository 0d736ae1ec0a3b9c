"""The planner prices series kept in host memory (``Plan.offload``): their bytes leave the device (counted here from
the config alone), the ring of ``k + 1`` of their layers joins it, their copies run on the device's host link under
the prefetch schedule, and the memory freed serves more sequences. Where the model does not fit a device without it,
the planner chooses it; on a device with no host link it is not weighed."""

import dataclasses

import pytest
import torch

from functional_npu.parallel import device
from functional_npu.runtime.planning import Workload, candidates, choose_plan, estimate, serve_estimate

from ..support.configs import DENSE

F32 = torch.float32
DEEP = dataclasses.replace(DENSE, num_layers=8)


def _one(name: str, devices: int = 1):
    return next(c for c in candidates(DEEP, devices, host_link=True) if c.name == name)


def _o_proj_bytes(cfg, e: int) -> int:
    """Every layer's o_proj, from the config: hidden x (heads x head dim) per layer."""
    return cfg.num_layers * cfg.hidden_size * cfg.num_heads * cfg.head_dim * e


def test_host_series_leave_the_device_and_their_ring_joins_it():
    plain = estimate(DEEP, _one("dp 1 x tp 1"), "910b", Workload.decode(2, 32, F32))
    off = estimate(DEEP, _one("dp 1 x tp 1, o_proj in host memory"), "910b", Workload.decode(2, 32, F32))
    host = _o_proj_bytes(DEEP, 4)
    assert off.bytes["host"] == host and plain.bytes["host"] == 0
    assert off.bytes["weights"] == plain.bytes["weights"] - host
    k = off.candidate.plan.prefetch_step
    assert off.bytes["prefetch"] == (k + 1) * host // DEEP.num_layers
    assert off.bytes["total"] == plain.bytes["total"] - host + off.bytes["prefetch"]
    # its copies: every layer's o_proj over the host link, some of it exposed; a step no faster than the plain one
    assert off.parts["host_copy_exposed_s"] > 0 and off.step_s > plain.step_s


def test_the_memory_freed_serves_more_sequences():
    work, memory = Workload.serve(64, 0.25, dtype=F32), 3e6
    plain = serve_estimate(DEEP, _one("dp 1 x tp 1"), "910b", work, memory_per_device=memory)
    off = serve_estimate(DEEP, _one("dp 1 x tp 1, layer in host memory"), "910b", work, memory_per_device=memory)
    assert off.batch > plain.batch and off.bytes["total"] <= memory and off.bytes["host"] > 0


def test_a_model_that_does_not_fit_without_it_is_served_with_it():
    """A budget below the plain plan's weights on one device: only plans with series in host memory serve."""
    work = Workload.serve(64, 0.25, dtype=F32)
    plain = estimate(DEEP, _one("dp 1 x tp 1"), "910b", Workload.decode(1, 63, F32))
    memory = plain.bytes["weights"] * 0.9
    placed, report = choose_plan(DEEP, 1, "910b", memory, work)
    assert placed.plan.offload, report
    assert all(e.candidate.plan.offload for e in report.ranked if e.batch > 0)


def test_no_host_link_no_offload_candidates():
    names = [c.name for c in candidates(DEEP, 2)]
    assert not any("host memory" in n for n in names)
    assert device("host").host_link is None and device("910b").host_link is not None
    with pytest.raises(ValueError, match=r"host has no host link in its profile \(its memory is the host's\)"):
        estimate(DEEP, _one("dp 1 x tp 1, o_proj in host memory"), "host", Workload.decode(2, 32, F32))
