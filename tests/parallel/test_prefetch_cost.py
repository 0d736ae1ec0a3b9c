"""The prefetch cost model and ``prefetch_step="auto"``: properties of the simulated schedule and of the choice."""

import dataclasses
import math

import pytest
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu.core.quant import Quant
from functional_npu.parallel.prefetch_cost import Device, Link, choose_k, exposed, roofline_layer_s, simulate, step_time

times = st.floats(0.01, 10.0)
layers = st.integers(2, 16)


@st.composite
def links(draw):
    occupy = draw(times)
    return occupy, occupy + draw(st.floats(0.0, 10.0))  # latency >= occupancy


@settings(max_examples=200, deadline=None)
@given(layers, times, links())
def test_exposure_is_a_fraction_that_never_grows_with_k(n, compute, link):
    occupy, latency = link
    costs = [exposed(n, k, compute, occupy, latency) for k in range(n - 1)]
    assert costs[0] == pytest.approx(1.0)  # k = 0: every broadcast waited for in full
    assert all(-1e-9 <= c <= 1 + 1e-9 for c in costs)
    assert all(b <= a + 1e-9 for a, b in zip(costs, costs[1:]))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), times, links(), st.integers(0, 7))
def test_the_closed_form_is_the_simulated_steady_state(n, compute, link, k):
    """Event by event, the per-step time converges to the max-plus cycle mean."""
    occupy, latency = link
    window = 6 * (k + 1)  # steps: a multiple of the k + 1 layers the critical loop may span
    end = simulate(n, k, compute, occupy, latency, 4 * window)
    tail = (end[-1] - end[-1 - window * n]) / window
    assert tail == pytest.approx(step_time(n, k, compute, occupy, latency), rel=2e-3)


@settings(max_examples=200, deadline=None)
@given(layers, times, links())
def test_step_time_bounds(n, compute, link):
    occupy, latency = link
    for k in range(n - 1):
        t = step_time(n, k, compute, occupy, latency)
        assert t >= n * compute - 1e-9 and t >= n * occupy - 1e-9  # compute and link both must fit
        assert t <= n * (compute + latency) + 1e-9  # never worse than synchronous


@settings(max_examples=200, deadline=None)
@given(layers, times, times, st.floats(0.0, 10.0))
def test_where_the_link_keeps_up_k_is_the_window_that_covers_latency(n, compute, occupy_frac, alpha):
    occupy = min(occupy_frac, compute)  # the link keeps up: a broadcast holds it no longer than a layer
    latency = occupy + alpha
    k = math.ceil(latency / compute - 1e-9)
    if 1 <= k <= n - 2:
        assert exposed(n, k, compute, occupy, latency) == pytest.approx(0.0, abs=1e-9)
        assert exposed(n, k - 1, compute, occupy, latency) > 1e-9 or latency <= (k - 1) * compute + 1e-9


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**8), layers, st.floats(1e-5, 1e-1), st.floats(1e6, 1e12), st.floats(0, 1e-3))
def test_choose_k_is_the_smallest_window_that_covers_a_slow_broadcast(nbytes, n, compute, bandwidth, alpha):
    link = Link(bandwidth, alpha)
    occupy = 1.25 * nbytes / bandwidth
    latency = max(occupy, 1.25 * link.time(nbytes))  # the same number, up to rounding
    for budget in (None, 2 * nbytes, 3.5 * nbytes):
        k = choose_k(nbytes, num_layers=n, compute_s=compute, link=link, budget_bytes=budget)
        top = n - 1 if budget is None else min(n - 1, int(budget // nbytes) - 1)
        assert 0 <= k <= max(0, top)
        assert k == top or k * compute >= latency * (1 - 1e-9)  # covered, unless capped
        assert k <= 1 or (k - 1) * compute < latency  # and no smaller k covers it
        if k >= 1 and occupy <= compute and k * compute >= latency:
            # where the link keeps up, the covering k hides the (25% slower) broadcasts entirely
            assert exposed(n, k, compute, occupy, latency) == pytest.approx(0.0, abs=1e-9)


def test_a_budget_below_one_layer_is_refused_naming_the_series_and_bytes():
    with pytest.raises(ValueError, match=r"1000 bytes does not hold one layer of o_proj,down_proj \(4096 bytes"):
        choose_k(4096, num_layers=8, compute_s=1e-3, link=Link(1e9), budget_bytes=1000, series="o_proj,down_proj")


def test_no_communication_needs_no_prefetch():
    assert choose_k(0, num_layers=8, compute_s=1e-3, link=Link(1e9)) == 0
    assert exposed(8, 0, 1.0, 0.0) == 0.0


def test_roofline_is_the_slower_of_memory_and_flops():
    d = Device("x", memory_bytes_per_s=1e12, flop_per_s=1e15, link=Link(1e11))
    assert roofline_layer_s(d, 2e9, 4e9) == pytest.approx(2e-3)  # decode: weights dominate
    assert roofline_layer_s(d, 2e9, 4e13) == pytest.approx(4e-2)  # prefill: flops dominate


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="latency >= occupancy"):
        step_time(4, 1, 1.0, 2.0, 1.0)
    with pytest.raises(ValueError, match="num_layers >= 1"):
        choose_k(10, num_layers=0, compute_s=1.0, link=Link(1.0))


def test_auto_on_layer_sharded_params(qwen3_params):
    """``prefetch_step="auto"``: the cost model on the params' own sizes, through compile_model; errors name
    the series, the bytes and the devices."""
    from functional_npu.parallel.prefetch_cost import DEVICES, auto_step, layer_bytes
    from functional_npu.runtime.serving.compile import compile_model

    params, mesh = qwen3_params
    plan = params.placement.plan
    auto = dataclasses.replace(plan, prefetch_step="auto")
    o, down = params["series"]["o_proj"], params["series"]["down"]
    assert layer_bytes(params) == (o[0].numel() + down[0].numel()) * 4
    for name in DEVICES:
        k = auto_step(params, plan, device=name)
        assert 0 <= k <= params.config.num_layers - 1
        assert compile_model(params, mesh, backend="none", plan=auto, prefetch_device=name).plan.prefetch_step == k
    assert auto_step(params, plan, device=DEVICES["host"], budget_bytes=layer_bytes(params)) == 0  # k = 0
    with pytest.raises(ValueError, match=r"does not hold one layer of o_proj,down \(\d+ bytes"):
        auto_step(params, plan, budget_bytes=layer_bytes(params) - 1)
    with pytest.raises(ValueError, match="prefetch device 'tpu' is not known; choose one of ascend-910b"):
        auto_step(params, plan, device="tpu")


@pytest.fixture(scope="module")
def qwen3_params(tmp_path_factory):
    from functional_npu import Plan
    from functional_npu.core.mesh import Mesh
    from functional_npu.parallel.layer_shard import layer_shard
    from functional_npu.runtime.loading.checkpoint import load_checkpoint

    from ..support.hf_models import save_tiny

    path = tmp_path_factory.mktemp("qwen3_auto")
    save_tiny("qwen3", path, 3, num_hidden_layers=6)
    mesh = Mesh.abstract({"dp": 2, "tp": 1}, 0)
    return load_checkpoint(str(path), mesh, Plan(layer_shard=layer_shard("o_proj,down_proj"))), mesh


@pytest.mark.parametrize("quant", [Quant(8, "channel"), Quant(4, "group", group_size=16)], ids=["int8", "int4"])
def test_auto_reads_quantized_layers(tmp_path, quant):
    """A quantized checkpoint's layers hold dicts of stored tensors (values, scales): the cost model counts every
    stored byte, and multiplies as many values per layer as the float model (packing changes bytes, not work)."""
    from functional_npu import Plan
    from functional_npu.core.mesh import Mesh
    from functional_npu.models import family_of
    from functional_npu.parallel.layer_shard import layer_shard
    from functional_npu.parallel.prefetch_cost import auto_step, layer_weight_bytes, layer_weight_elements
    from functional_npu.runtime.loading.checkpoint import load_checkpoint
    from functional_npu.runtime.loading.save import save_checkpoint

    from ..support.configs import DENSE

    full = family_of(DENSE).init_params(DENSE, seed=0)
    save_checkpoint(full, tmp_path, quant=quant)
    mesh = Mesh.abstract({"dp": 2, "tp": 1}, 0)
    params = load_checkpoint(str(tmp_path), mesh, Plan(layer_shard=layer_shard("o_proj,down_proj")))
    assert isinstance(params["series"]["o_proj"], dict)  # the case the cost model once read as a tensor
    quant = params.placement.quant
    assert layer_weight_elements(params, quant) == sum(t.numel() for t in full["layers"][0].values())
    stored = pytree.tree_leaves(
        [params["layers"][0], {k: [t[0] for t in pytree.tree_leaves(v)] for k, v in params["series"].items()}]
    )
    assert layer_weight_bytes(params) == sum(t.numel() * t.element_size() for t in stored)
    assert 0 <= auto_step(params, params.placement.plan, quant) <= DENSE.num_layers - 1


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(2, 12),
    gbps=st.floats(0.5, 200.0),
    alpha_us=st.floats(0.0, 200.0),
)
def test_auto_for_host_series_is_the_least_k_the_schedule_leaves_as_little_exposed(layers, gbps, alpha_us):
    """``prefetch_step="auto"`` with series kept in host memory alone: the smallest k whose exposed time is within 1%
    of the least, counted here by the event-by-event schedule (:func:`simulate`) over every k; without a host link in
    the device's profile (this host), one layer ahead."""
    import types

    import torch

    from functional_npu import Params, Plan
    from functional_npu.parallel.devices import DEVICES
    from functional_npu.parallel.prefetch_cost import auto_step

    host = torch.zeros(layers, 256, 512)  # 512 KiB per layer, float32
    tree = {
        "embed": torch.zeros(1),
        "layers": [{"norm": torch.zeros(512)} for _ in range(layers)],
        "host": {"down": host},
    }
    params = Params(tree, types.SimpleNamespace(num_layers=layers))
    dev = dataclasses.replace(DEVICES["ascend-910b"], host_link=Link(bytes_per_s=gbps * 1e9, alpha_s=alpha_us * 1e-6))
    per_layer = 256 * 512 * 4
    compute = roofline_layer_s(dev, per_layer + 512 * 4, 2.0 * (256 * 512 + 512))
    occupy, latency = per_layer / dev.host_link.bytes_per_s, dev.host_link.time(per_layer)
    steps, cost = 40, []
    for k in range(layers):
        ends = simulate(layers, k, compute, occupy, latency, steps)
        per_step = (ends[-1] - ends[2 * layers - 1]) / (steps - 2)  # averaged: a ring of k + 1 need not divide L
        cost.append((per_step - layers * compute) / (layers * latency))
    got = auto_step(params, Plan(offload="down_proj", prefetch_step="auto"), device=dev)
    slack = 1e-3  # the finite schedule's averaging, at a k whose cost sits on the 1% line
    assert cost[got] <= min(cost) + 0.01 + slack and all(c > min(cost) + 0.01 - slack for c in cost[:got])
    assert auto_step(params, Plan(offload="down_proj", prefetch_step="auto"), device="host") == 1
