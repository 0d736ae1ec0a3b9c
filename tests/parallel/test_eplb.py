"""EPLB: placement validation, routing table, rebalance planning (simulated for every rank) and execution on gloo."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu import Mesh
from functional_npu.core.tree import flatten_with_paths
from functional_npu.eplb import (
    default_placement,
    plan_rebalance,
    rank_program,
    rebalance,
    routing_table,
    validate_placement,
)
from functional_npu.parallel.eplb_map import _assemble, _send_rows

from ..support.eplb_workers import expert_weights, moe_params, placed


@st.composite
def placement_layer(draw, experts: int, ranks: int, slots: int) -> list[list[int]]:
    """Every expert once, the spare slots filled with redundant copies, in a random order."""
    ids = list(range(experts)) + draw(
        st.lists(st.integers(0, experts - 1), min_size=ranks * slots - experts, max_size=ranks * slots - experts)
    )
    ids = draw(st.permutations(ids))
    return [list(ids[r * slots : (r + 1) * slots]) for r in range(ranks)]


@st.composite
def placements(draw, n: int = 2):
    """``n`` placements of the same [layers, ranks, slots], their expert count and an expert-axis mesh."""
    axes = draw(st.sampled_from([{"ep": 1}, {"ep": 2}, {"ep": 3}, {"ep": 4}, {"dp": 2, "tp": 2}, {"dp": 3, "tp": 2}]))
    ranks = Mesh.abstract(axes).size
    experts = draw(st.integers(1, 9))
    slots = draw(st.integers(max(1, -(-experts // ranks)), -(-experts // ranks) + 2))
    layers = draw(st.integers(1, 3))
    maps = [[draw(placement_layer(experts, ranks, slots)) for _ in range(layers)] for _ in range(n)]
    return Mesh.abstract(axes), experts, maps


def simulate(plan, locals_: list[list[torch.Tensor]], mesh: Mesh) -> list[list[torch.Tensor]]:
    """Run every rank's program in one process; the uneven all_to_all is done by hand."""
    axis = tuple(mesh.axis_names)
    progs = [rank_program(plan, mesh.at(r).axis_index(axis)) for r in range(mesh.size)]
    sends = [_send_rows(xs, p) for xs, p in zip(locals_, progs)]
    offsets = [[sum(len(d) for d in p.send[:j]) for j in range(mesh.size)] for p in progs]
    out = []
    for r, (xs, p) in enumerate(zip(locals_, progs)):
        parts = [sends[j][offsets[j][r] : offsets[j][r] + len(progs[j].send[r])] for j in range(mesh.size)]
        assert [len(x) for x in parts] == list(p.recv_counts)
        out.append(_assemble(xs, torch.cat(parts), p))
    return out


@settings(max_examples=300)
@given(placements(), st.integers(0, 2**16))
def test_simulated_moves_give_the_new_placement_from_the_old(case, seed):
    mesh, experts, (old, new) = case
    old, new = torch.tensor(old), torch.tensor(new)
    gate_up, down = expert_weights(old.shape[0], experts, 2, 3, torch.float32, seed)
    plan = plan_rebalance(old, new, experts)
    before = [[gu.clone() for gu, _ in placed(gate_up, down, old, r)] for r in range(mesh.size)]
    start = [[gu for gu, _ in placed(gate_up, down, old, r)] for r in range(mesh.size)]
    got = simulate(plan, start, mesh)
    for r in range(mesh.size):
        for li, (want, _) in enumerate(placed(gate_up, down, new, r)):
            assert torch.equal(got[r][li], want), (r, li)
            assert torch.equal(start[r][li], before[r][li])  # inputs untouched


@settings(max_examples=300)
@given(placements())
def test_moves_are_the_lower_bound_and_come_from_holders(case):
    _, experts, (old, new) = case
    plan = plan_rebalance(old, new, experts)
    need = {(li, r, e) for li in range(len(old)) for r in range(len(old[0])) for e in set(new[li][r]) - set(old[li][r])}
    assert {(m.layer, m.dst_rank, m.expert) for m in plan.moves} == need and len(plan.moves) == len(need)
    for m in plan.moves:
        assert old[m.layer][m.src_rank][m.src_slot] == m.expert and m.src_rank != m.dst_rank
    assert plan.bytes_moved(10) == 10 * len(need)
    assert plan_rebalance(old, old, experts).moves == ()


def test_sources_spread_over_the_holders_of_a_hot_expert():
    old = [[[0, 1, 2], [0, 3, 4], [5, 6, 7], [5, 6, 7]]]  # expert 0 on ranks 0 and 1
    new = [[[0, 1, 2], [0, 3, 4], [0, 5, 6], [0, 7, 5]]]  # ranks 2 and 3 each need a copy
    plan = plan_rebalance(old, new, 8)
    assert [(m.expert, m.src_rank, m.src_slot, m.dst_rank) for m in plan.moves] == [(0, 0, 0, 2), (0, 1, 0, 3)]
    twice = plan_rebalance([[[0, 1], [2, 3]]], [[[0, 1], [3, 2]], [[0, 2], [3, 1]]][:1], 4)
    assert twice.moves == ()  # a permutation inside a rank is local
    dup = plan_rebalance([[[0, 1], [2, 3]]], [[[2, 1], [0, 3]]], 4).moves
    assert [(m.expert, m.dst_rank) for m in dup] == [(2, 0), (0, 1)]


@settings(max_examples=200)
@given(placements(n=1), st.integers(0, 2))
def test_routing_table_lists_every_slot_of_every_expert(case, extra):
    _, experts, (p,) = case
    table = routing_table(torch.tensor(p), experts)
    flat = torch.tensor(p).reshape(len(p), -1)
    width = max(int((row == e).sum()) for row in flat for e in range(experts))
    assert table.dtype == torch.int64 and tuple(table.shape) == (len(p), experts, width)
    for li, row in enumerate(flat):
        for e in range(experts):
            slots = [s for s in range(row.numel()) if int(row[s]) == e]
            assert table[li, e].tolist() == slots + [-1] * (width - len(slots))
    assert torch.equal(routing_table(torch.tensor(p), experts, copies=width + extra)[..., :width], table)


def test_default_placement_is_the_identity_map():
    p = default_placement(2, 8, 4)
    assert p.tolist() == [[[0, 1], [2, 3], [4, 5], [6, 7]]] * 2
    assert torch.equal(routing_table(p, 8)[1], torch.arange(8)[:, None])
    with pytest.raises(ValueError, match="6 experts cannot be split evenly over an expert axis of size 4"):
        default_placement(1, 6, 4)


# ---- routing through a redundant placement is exact: an independent reference MoE FFN -------------
def reference_moe(x, router, gate_up, down, top_k):
    """Per token, per chosen logical expert: softmax top-k, renormalised (Qwen3-MoE), SwiGLU expert."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(router @ x[t], dim=0)
        w, ids = torch.topk(probs, top_k)
        w = w / w.sum()
        for k in range(top_k):
            g, u = (gate_up[ids[k]] @ x[t]).chunk(2)
            out[t] += w[k] * (down[ids[k]] @ (torch.nn.functional.silu(g) * u))
    return out


def physical_moe(x, router, local_gate_up, local_down, expert_map, top_k):
    """EP-style: route to logical experts, map each (token, expert) to a physical slot with the table,
    let each rank run its own slots on the tokens sent to them, and sum what the ranks return."""
    probs = torch.softmax(x @ router.T, dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    counts = (expert_map >= 0).sum(1)  # [E]
    tokens = torch.arange(x.shape[0])[:, None].expand_as(ids)
    slot = expert_map[ids, tokens % counts[ids]]  # [T, k]
    per_rank = local_gate_up[0].shape[0]
    out = torch.zeros_like(x)
    for r, (gu, dn) in enumerate(zip(local_gate_up, local_down)):
        mine = (slot // per_rank) == r
        t_idx, k_idx = mine.nonzero(as_tuple=True)
        local = slot[t_idx, k_idx] % per_rank
        g, u = torch.einsum("nfd,nd->nf", gu[local], x[t_idx]).chunk(2, dim=-1)
        y = torch.einsum("ndf,nf->nd", dn[local], torch.nn.functional.silu(g) * u)
        out.index_add_(0, t_idx, w[t_idx, k_idx, None] * y)
    return out


@settings(max_examples=25)
@given(placements(n=1), st.integers(1, 3), st.integers(0, 2**16))
def test_physical_routing_through_a_redundant_placement_matches_the_logical_reference(case, top_k, seed):
    mesh, experts, (p,) = case
    top_k = min(top_k, experts)
    p = torch.tensor(p)
    gate_up, down = expert_weights(1, experts, 3, 4, torch.float64, seed)
    g = torch.Generator().manual_seed(seed)
    x, router = (
        torch.randn(11, 4, generator=g, dtype=torch.float64),
        torch.randn(experts, 4, generator=g, dtype=torch.float64),
    )
    local = [placed(gate_up, down, p[:1], r)[0] for r in range(mesh.size)]
    table = routing_table(p[:1], experts)[0]
    got = physical_moe(x, router, [gu for gu, _ in local], [dn for _, dn in local], table, top_k)
    torch.testing.assert_close(got, reference_moe(x, router, gate_up[0], down[0], top_k), rtol=1e-12, atol=1e-12)


# ---- bad input ----------------------------------------------------------------------------------
BAD_PLACEMENTS = [
    (
        [[[0, 1], [2]]],
        3,
        None,
        ValueError,
        r"placement layer 0 rank 1 has 1 slots but rank 0 of layer 0 has 2; every rank needs the same number of slots",
    ),
    ([[[0, 1], [2, 0]], [[0, 1]]], 3, None, ValueError, r"placement layer 1 has 1 ranks but layer 0 has 2"),
    (
        [[[0, 1], [1, 1]]],
        3,
        None,
        ValueError,
        r"placement layer 0 places no copy of experts \[2\]; every expert needs at least one slot",
    ),
    ([[[0, 1], [2, 5]]], 3, None, ValueError, r"placement\[0, 1, 1\] = 5 is not an expert id in \[0, 3\)"),
    ([[[0, 1], [2, -1]]], 3, None, ValueError, r"placement\[0, 1, 1\] = -1 is not an expert id"),
    (
        [[[0, 1, 2]]],
        4,
        None,
        ValueError,
        r"placement has 1 ranks x 3 slots = 3 slots for 4 experts; use at least 4 slots per rank",
    ),
    ([[[0, 1], [2, 0]]], 3, 4, ValueError, r"placement spans 2 ranks but the expert axis has size 4"),
    (
        torch.zeros(2, 2, dtype=torch.long),
        1,
        None,
        ValueError,
        r"placement has shape \(2, 2\); expected 3 dims \[layers, ranks, slots\]",
    ),
    (torch.zeros(1, 2, 2), 1, None, TypeError, r"placement has dtype torch.float32; expected an integer tensor"),
    ("0,1", 2, None, TypeError, r"placement is a str; expected an int tensor or nested lists"),
]


@pytest.mark.parametrize("placement,experts,ranks,error,message", BAD_PLACEMENTS)
def test_bad_placement_is_a_clear_error(placement, experts, ranks, error, message):
    with pytest.raises(error, match=message):
        validate_placement(placement, experts, num_ranks=ranks)


def test_ragged_or_non_int_slots_are_errors():
    with pytest.raises(TypeError, match=r"placement\[0\]\[1\] is 2; expected a list of int expert ids"):
        validate_placement([[[0, 1], 2]], 3)
    with pytest.raises(TypeError, match=r"placement\[0\]\[0\] is \[0, 1.5\]"):
        validate_placement([[[0, 1.5], [2, 0]]], 3)


def test_plan_and_routing_errors():
    with pytest.raises(
        ValueError,
        match=r"old placement has shape \(1, 2, 2\) and new \(1, 1, 4\) \[layers, ranks, slots\]; a rebalance keeps",
    ):
        plan_rebalance([[[0, 1], [2, 0]]], [[[0, 1, 2, 0]]], 3)
    with pytest.raises(ValueError, match=r"new placement layer 0 places no copy of experts \[2\]"):
        plan_rebalance([[[0, 1], [2, 0]]], [[[0, 1], [1, 0]]], 3)
    with pytest.raises(
        ValueError, match=r"routing_table: expert 0 has 2 copies in layer 0 but copies=1; raise copies to 2"
    ):
        routing_table(torch.tensor([[[0, 1], [2, 0]]]), 3, copies=1)
    with pytest.raises(ValueError, match="rank_program: rank 2 is outside the expert axis of size 2"):
        rank_program(plan_rebalance([[[0, 1], [2, 0]]], [[[0, 1], [2, 1]]], 3), 2)


def _params(old, experts=3):
    gate_up, down = expert_weights(len(old), experts, 2, 3, torch.float32, 0)
    return moe_params(placed(gate_up, down, torch.tensor(old), 0), routing_table(torch.tensor(old), experts))


OLD, NEW = [[[0, 1], [2, 0]]] * 2, [[[0, 1], [2, 1]], [[2, 1], [0, 0]]]


@pytest.mark.parametrize(
    "mutate,mesh_axes,message,error",
    [
        (lambda p: p, {"ep": 4}, r"rebalance: the plan spans 2 ranks but mesh axis 'ep' has size 4", ValueError),
        (
            lambda p: p | {"layers": p["layers"][:1]},
            {"ep": 2},
            r"rebalance: params have 1 MoE layers \(with 'experts_gate_up'\) but the plan has 2",
            ValueError,
        ),
        (
            lambda p: (
                p
                | {"layers": [p["layers"][0] | {"experts_down": p["layers"][0]["experts_down"][:1]}] + p["layers"][1:]}
            ),
            {"ep": 2},
            r"params\['layers.0.experts_down'\] has local shape \(1, 3, 2\), 1 slots on this rank, "
            r"but the placement has 2 slots per rank over mesh axis 'ep' \(size 2\)",
            ValueError,
        ),
        (
            lambda p: p | {"layers": [p["layers"][0] | {"experts_down": None}] + p["layers"][1:]},
            {"ep": 2},
            r"params\['layers.0.experts_down'\] is NoneType",
            TypeError,
        ),
        (
            lambda p: p | {"layers": [p["layers"][0] | {"expert_map": torch.zeros(5, 1)}] + p["layers"][1:]},
            {"ep": 2},
            r"params\['layers.0.expert_map'\] has 5 experts but the plan has 3",
            ValueError,
        ),
        (lambda p: [p], {"ep": 2}, r"rebalance: params must be a dict with a 'layers' list", TypeError),
    ],
)
def test_rebalance_bad_input_is_an_error_before_any_communication(mutate, mesh_axes, message, error):
    params = mutate(_params(OLD))
    leaves = [x for _, x in flatten_with_paths(params) if isinstance(x, torch.Tensor)]
    snapshot = [x.clone() for x in leaves]
    mesh = Mesh.abstract(mesh_axes, 0)  # abstract: any collective would raise RuntimeError first
    with pytest.raises(error, match=message):
        rebalance(params, plan_rebalance(OLD, NEW, 3), mesh, "ep")
    assert leaves and all(torch.equal(a, b) for a, b in zip(snapshot, leaves))  # nothing half-moved


def test_rebalance_keeps_the_expert_map_width_or_says_why_not():
    old, new = [[[0, 1], [0, 1]]], [[[0, 1], [1, 1]]]  # width 2, then expert 1 three times
    gate_up, down = expert_weights(1, 2, 2, 3, torch.float32, 0)
    params = moe_params(placed(gate_up, down, torch.tensor(old), 0), routing_table(torch.tensor(old), 2))
    with pytest.raises(
        ValueError,
        match=r"rebalance \(the new expert_map keeps the old width unless copies= is given\): "
        r"expert 1 has 3 copies in layer 0 but copies=2; raise copies to 3",
    ):
        rebalance(params, plan_rebalance(old, new, 2), Mesh.abstract({"ep": 2}, 0), "ep")


def test_rebalance_without_moves_needs_no_communication_and_copies():
    params = _params(OLD)
    out = rebalance(params, plan_rebalance(OLD, OLD, 3), Mesh.abstract({"ep": 2}, 0), "ep")
    for a, b in zip(out["layers"], params["layers"]):
        if "experts_gate_up" in a:
            assert (
                torch.equal(a["experts_gate_up"], b["experts_gate_up"])
                and a["experts_gate_up"] is not b["experts_gate_up"]
            )
    with pytest.raises(TypeError, match="rebalance: plan is a list; build it with plan_rebalance"):
        rebalance(params, [], Mesh.abstract({"ep": 2}, 0), "ep")
