"""Hostile inputs to the parallel layer's pure faces (the cost model, layer ownership, expert maps, the plan and its
parts, device profiles): each refused in one line naming the parameter and the value; an unbounded budget
(``math.inf``) answers as no budget does."""

import math
import re

import pytest

from functional_npu import Mesh, Params, Plan, place, tree_from_paths
from functional_npu.parallel import DEVICES, LayerShard, Link, dp_axes, owned_layers, resident_bytes
from functional_npu.parallel.eplb_map import default_placement, rank_program
from functional_npu.parallel.module_tp import ModuleTP
from functional_npu.parallel.prefetch_cost import (
    auto_step,
    choose_k,
    exposed,
    host_step,
    roofline_layer_s,
    simulate,
    step_time,
)

from ..support.configs import DENSE

NAN, INF = float("nan"), float("inf")
LINK = Link(1e9)
HOST = DEVICES["host"]
MESH4 = Mesh.abstract({"dp": 2, "tp": 2})
TIMES = (
    "must be a finite number of seconds >= 0, got nan; give the measured or modelled time (roofline_layer_s, Link.time)"
)

REFUSED = [
    # step_time / exposed / simulate: NaN and inf are refused by name (NaN passes `<`)
    (lambda: step_time(4, 1, 1.0, NAN), ValueError, f"step_time: occupy_s {TIMES}"),
    (lambda: step_time(4, 1, NAN, 1.0), ValueError, f"step_time: compute_s {TIMES}"),
    (lambda: step_time(4, 1, 1.0, 1.0, NAN), ValueError, f"step_time: latency_s {TIMES}"),
    (
        lambda: step_time(4, 1, INF, 1.0),
        ValueError,
        "step_time: compute_s must be a finite number of seconds >= 0, got inf",
    ),
    (lambda: exposed(4, 1, 1.0, NAN, 1.0), ValueError, f"exposed: occupy_s {TIMES}"),
    (lambda: simulate(4, 1, 1.0, 1.0, NAN, 2), ValueError, f"simulate: latency_s {TIMES}"),
    (lambda: simulate(4, 1, 1.0, 1.0, 1.0, 0), ValueError, "simulate: steps must be an int >= 1, got 0"),
    (lambda: step_time(4, 1.5, 1.0, 1.0), ValueError, "step_time: needs num_layers >= 1, k >= 0, times >= 0"),
    # choose_k / host_step
    (
        lambda: choose_k(100, num_layers=4, compute_s=NAN, link=LINK),
        ValueError,
        "choose_k: compute_s must be a finite number >= 0, got nan",
    ),
    (
        lambda: choose_k(100, num_layers=4, compute_s=1e-6, link=LINK, margin=NAN),
        ValueError,
        "choose_k: margin must be a finite number >= 0, got nan",
    ),
    (
        lambda: choose_k(100, num_layers=4, compute_s=1e-6, link=None),
        TypeError,
        "choose_k: link must be a Link (bytes_per_s, alpha_s), e.g. Link(25e9), got None",
    ),
    (
        lambda: choose_k(100, num_layers=4, compute_s=1e-6, link=LINK, budget_bytes=NAN),
        ValueError,
        "choose_k: budget_bytes must be a number of bytes (None or math.inf: no limit), got nan",
    ),
    (
        lambda: host_step(100, num_layers=4, compute_s=NAN, link=LINK),
        ValueError,
        "host_step: compute_s must be a finite number >= 0, got nan",
    ),
    (
        lambda: host_step(NAN, num_layers=4, compute_s=1e-6, link=LINK),
        ValueError,
        "host_step: layer_bytes must be a finite number >= 0, got nan",
    ),
    # owned_layers
    (lambda: owned_layers(4, 2, -1), ValueError, "owned_layers: c must be an int >= 0, got -1"),
    (
        lambda: owned_layers(4, 2, 2),
        ValueError,
        "owned_layers: coordinate c=2 is outside an axis of size n=2; give 0 <= c < 2",
    ),
    (lambda: owned_layers(4, 0, 0), ValueError, "owned_layers: n must be an int >= 1, got 0"),
    # default_placement
    (
        lambda: default_placement(2, 4.0, 2),
        ValueError,
        "default_placement: num_experts must be a positive int, got 4.0",
    ),
    (lambda: default_placement(0, 4, 2), ValueError, "default_placement: num_layers must be a positive int, got 0"),
    (
        lambda: rank_program({}, 0),
        TypeError,
        "rank_program: plan must be a RebalancePlan (plan_rebalance(old, new)), got {}",
    ),
    # the plan and its parts
    (
        lambda: Plan(prefetch_step=2**70),
        ValueError,
        f"Plan.prefetch_step {2**70} is past any model's layers: a ring of k + 1 slots holds at most all of them; "
        f"give an int in [0, 65536] (place() bounds it by num_layers - 1) or 'auto'",
    ),
    (
        lambda: Plan(module_tp={"o_proj": 3}),
        ValueError,
        "ModuleTP.o_proj must be mesh axis names such as ('dp2',) (module TP over dp ranks), got 3; to give a size, "
        "split dp with split_dp(axes, {'o_proj': 3})",
    ),
    (lambda: ModuleTP(mlp=[1]), ValueError, "ModuleTP.mlp must be mesh axis names such as ('dp2',)"),
    (lambda: LayerShard(3, "x"), ValueError, "LayerShard: axis must be a mesh axis name such as 'dp', got 3"),
    (
        lambda: LayerShard("dp", "o_proj"),
        ValueError,
        "LayerShard: leaves must be a non-empty tuple of series names such as ('o_proj', 'down'), got 'o_proj'; or "
        "build one from 'o_proj,down' with layer_shard(...)",
    ),
    (
        lambda: dp_axes(MESH4, "zz"),
        ValueError,
        "dp_axes: tp_axis 'zz' is not an axis of the mesh {'dp': 2, 'tp': 2}; name its tensor-parallel axis (a mesh "
        "without one has a 'tp' axis of size 1)",
    ),
    (
        lambda: resident_bytes("abc"),
        TypeError,
        "resident_bytes: expected a tensor or a pytree of them (params, a ring's slots), got str 'abc'",
    ),
    (
        lambda: resident_bytes(None),
        TypeError,
        "resident_bytes: expected a tensor or a pytree of them (params, a ring's slots), got NoneType None",
    ),
    # device profiles
    (lambda: LINK.time(-5), ValueError, "Link.time: nbytes must be a finite number of bytes >= 0, got -5"),
    (lambda: LINK.time(NAN), ValueError, "Link.time: nbytes must be a finite number of bytes >= 0, got nan"),
    (
        lambda: roofline_layer_s(HOST, -5, 1.0),
        ValueError,
        "roofline_layer_s: weight_bytes must be a finite number >= 0, got -5",
    ),
    (
        lambda: roofline_layer_s(HOST, 5, NAN),
        ValueError,
        "roofline_layer_s: flops must be a finite number >= 0, got nan",
    ),
    (
        lambda: HOST.collective_s("all_reduce", 0, 8),
        ValueError,
        "collective_s: n (the group's ranks) must be an int >= 1, got 0",
    ),
    (
        lambda: HOST.collective_s("all_reduce", -4, 8),
        ValueError,
        "collective_s: n (the group's ranks) must be an int >= 1, got -4",
    ),
    (
        lambda: HOST.collective_s("all_reduce", 2, NAN),
        ValueError,
        "collective_s: payload_bytes must be a finite number of bytes >= 0, got nan",
    ),
]


@pytest.mark.parametrize("call, error, message", REFUSED, ids=[m[:60] for _, _, m in REFUSED])
def test_refused_in_one_line(call, error, message):
    with pytest.raises(error, match=re.escape(message)) as e:
        call()
    assert "\n" not in str(e.value)


def test_an_unbounded_budget_is_no_budget():
    """``budget_bytes=math.inf`` chooses what no budget chooses (it once reached ``int(inf // n)``)."""
    for nbytes, compute in ((100, 1e-6), (10**9, 1e-3), (0, 1e-3)):
        kw = {"num_layers": 8, "compute_s": compute, "link": LINK}
        assert choose_k(nbytes, budget_bytes=math.inf, **kw) == choose_k(nbytes, **kw)


def test_an_unbounded_budget_for_host_series_is_no_budget():
    """``auto_step`` of series kept in host memory: ``math.inf`` is no budget (it once reached ``int(inf // n)``)."""
    placed = place(DENSE, {"tp": 1}, Plan(offload="down_proj"))
    tree = tree_from_paths(placed.meta_leaves)  # meta tensors: auto_step reads shapes and sizes only
    tree["layers"] = [tree["layers"][str(i)] for i in range(DENSE.num_layers)]
    params, device = Params(tree, DENSE), DEVICES["ascend-910b"]
    assert auto_step(params, placed.plan, device=device, budget_bytes=math.inf) == auto_step(
        params, placed.plan, device=device
    )


def test_valid_inputs_still_answer():
    assert owned_layers(4, 2, 1) == [1, 3]
    assert default_placement(1, 4, 2).tolist() == [[[0, 1], [2, 3]]]
    assert step_time(4, 1, 1.0, 1.0) == pytest.approx(4.0)
    assert HOST.collective_s("all_reduce", 1, 0) == 0.0
    assert dp_axes(MESH4, "tp") == ("dp",)
