"""EP <-> TP expert-weight conversion: equals shard_TP(gather_EP(x)), round trip is the identity, errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu import Mesh, fused, shard, sharded, unshard
from functional_npu.interop import ep_to_tp, expert_layouts, tp_to_ep
from functional_npu.parallel.ep_tp import _pack, _unpack

from ..support.strategies import make_tensor

NAMES = ("experts_gate_up", "experts_down")


def simulate(locals_: list[dict], n: int, to_tp: bool) -> list[dict]:
    """Every rank's pack, an all_to_all done by hand (row c of rank j goes to rank c), every rank's unpack."""
    out = [dict() for _ in range(n)]
    for name in NAMES:
        sent = [_pack(name, t[name], n, to_tp) for t in locals_]
        for c in range(n):
            out[c][name] = _unpack(name, torch.stack([sent[j][c] for j in range(n)]), to_tp)
    return out


@st.composite
def expert_case(draw):
    axes = draw(st.sampled_from([{"ep": 1}, {"ep": 2}, {"ep": 3}, {"ep": 4}, {"dp": 2, "tp": 2}, {"dp": 2, "tp": 3}]))
    axis = tuple(axes) if len(axes) > 1 else "ep"
    n = Mesh.abstract(axes).axis_size(axis)
    experts, ffn = n * draw(st.integers(1, 3)), n * draw(st.integers(1, 3))
    hidden = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64]))
    seed = draw(st.integers(0, 2**20))
    full = {
        "experts_gate_up": make_tensor((experts, 2 * ffn, hidden), dtype, seed),
        "experts_down": make_tensor((experts, hidden, ffn), dtype, seed + 1),
    }
    return Mesh.abstract(axes), axis, ffn, full


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


@settings(max_examples=150)
@given(expert_case())
def test_ep_to_tp_equals_shard_tp_of_gather_ep_and_round_trips(case):
    mesh, axis, ffn, full = case
    ep_specs, tp_specs = expert_layouts("ep", ffn, axis), expert_layouts("tp", ffn, axis)
    ep = [shard(full, ep_specs, mesh, coordinate=r) for r in range(mesh.size)]
    gathered = unshard(ep, ep_specs, mesh)  # gather_EP, done in one process
    tp = simulate(ep, mesh.size, to_tp=True)
    for r in range(mesh.size):
        want = shard(gathered, tp_specs, mesh, coordinate=r)
        for name in NAMES:
            assert tp[r][name].dtype == want[name].dtype and torch.equal(_bits(tp[r][name]), _bits(want[name])), (
                r,
                name,
            )
    back = simulate(tp, mesh.size, to_tp=False)
    for r in range(mesh.size):
        for name in NAMES:
            assert torch.equal(_bits(back[r][name]), _bits(ep[r][name])), (r, name)


def test_layouts_are_gate_up_blocks_and_row_parallel_down():
    tp = expert_layouts("tp", 8, ("dp", "tp"))
    assert tp["experts_gate_up"] == fused(1, [("gate", 8), ("up", 8)], ("dp", "tp"))
    assert tp["experts_down"] == sharded(2, ("dp", "tp"))
    assert expert_layouts("ep", 8, "ep") == {"experts_gate_up": sharded(0, "ep"), "experts_down": sharded(0, "ep")}
    with pytest.raises(ValueError, match="kind must be 'ep' or 'tp', got 'dp'"):
        expert_layouts("dp", 8, "ep")


def test_size_one_axis_copies_and_passes_other_leaves():
    mesh = Mesh.abstract({"ep": 1}, 0)
    tree = {
        "layers": [
            {"experts_gate_up": torch.randn(2, 4, 3), "experts_down": torch.randn(2, 3, 2), "router": torch.randn(2, 3)}
        ]
    }
    out = ep_to_tp(tree, mesh, "ep")
    layer, src = out["layers"][0], tree["layers"][0]
    assert layer["router"] is src["router"]
    assert torch.equal(layer["experts_down"], src["experts_down"]) and layer["experts_down"] is not src["experts_down"]


BAD = [
    (
        True,
        {"experts_gate_up": torch.zeros(2, 5, 3)},
        r"params\['experts_gate_up'\] has 5 rows on dim 1 .* odd number, so it is not \[gate \| up\]",
    ),
    (
        True,
        {"experts_gate_up": torch.zeros(2, 6, 3)},
        r"params\['experts_gate_up'\] \(shape \(2, 6, 3\)\): the expert intermediate size F = 3 on dim 1 "
        r"is cut over mesh axis 'ep' \(size 2\).*2 does not divide 3",
    ),
    (
        True,
        {"experts_down": torch.zeros(2, 3, 5)},
        r"params\['experts_down'\] \(shape \(2, 3, 5\)\): "
        r"the expert intermediate size F = 5 on dim 2 .* 'ep' \(size 2\)",
    ),
    (
        False,
        {"experts_down": torch.zeros(3, 3, 2)},
        r"params\['experts_down'\] \(shape \(3, 3, 2\)\) holds 3 experts on dim 0, "
        r"which the EP layout splits over mesh axis 'ep' \(size 2\), but 2 does not divide 3",
    ),
    (
        True,
        {"l": {"experts_gate_up": torch.zeros(2, 8, 3), "experts_down": torch.zeros(2, 3, 2)}},
        r"params\['l.experts_down'\] implies expert intermediate size F = 2 "
        r"but params\['l.experts_gate_up'\] implies 4",
    ),
    (
        True,
        {"experts_gate_up": torch.zeros(8, 3)},
        r"params\['experts_gate_up'\] is \(8, 3\); expected a stacked expert tensor of 3 dims \(\[E, 2F, D\]\)",
    ),
    (True, {"router": torch.zeros(2, 3)}, r"ep_to_tp: params have no 'experts_gate_up' or 'experts_down' leaf"),
]


@pytest.mark.parametrize("to_tp,tree,message", BAD)
def test_bad_input_is_a_clear_error_before_any_communication(to_tp, tree, message):
    mesh = Mesh.abstract({"ep": 2}, 0)  # abstract: a collective would raise RuntimeError, so a ValueError came first
    with pytest.raises(ValueError, match=message):
        (ep_to_tp if to_tp else tp_to_ep)(tree, mesh, "ep")
