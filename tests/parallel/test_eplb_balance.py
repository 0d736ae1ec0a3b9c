"""balanced_placement: redundant copies go to the hot experts, spread over ranks; errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu.eplb import balanced_placement, default_placement, plan_rebalance, routing_table, validate_placement


@st.composite
def load_case(draw):
    ranks = draw(st.integers(1, 5))
    experts = draw(st.integers(1, 12))
    slots = draw(st.integers(-(-experts // ranks), experts))
    layers = draw(st.integers(1, 3))
    load = draw(
        st.lists(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts), min_size=layers, max_size=layers)
    )
    return torch.tensor(load, dtype=torch.float32), ranks, slots


@settings(max_examples=300)
@given(load_case())
def test_hotter_experts_get_at_least_as_many_copies_each_on_its_own_rank(case):
    load, ranks, slots = case
    p = balanced_placement(load, ranks, slots)
    experts = load.shape[1]
    assert tuple(p.shape) == (load.shape[0], ranks, slots)
    validate_placement(p, experts, num_ranks=ranks)
    for li in range(load.shape[0]):
        copies = torch.bincount(p[li].flatten(), minlength=experts)
        assert int(copies.sum()) == ranks * slots and int(copies.max()) <= ranks
        for a in range(experts):
            for b in range(experts):
                if load[li, a] > load[li, b] and copies[a] < ranks:
                    assert copies[a] >= copies[b], (li, a, b, copies.tolist())
        for r in range(ranks):
            assert len(set(p[li, r].tolist())) == slots, p[li, r]  # no rank holds one expert twice


def test_skewed_load_is_spread_better_than_the_default_map():
    g = torch.Generator().manual_seed(0)
    load = torch.rand(2, 64, generator=g) ** 6 * 1000

    def worst(p):
        copies = torch.stack([torch.bincount(row.flatten(), minlength=64) for row in p]).double()
        per_slot = load.double() / copies
        return max(float(per_slot[li][p[li, r]].sum()) for li in range(2) for r in range(p.shape[1])) / float(
            load.sum(1).max() / 4
        )

    balanced, default = balanced_placement(load, 4, 18), default_placement(2, 64, 4)
    assert worst(balanced) < 1.05 < 1.3 < worst(default)  # near the mean with 8 redundant slots; the default is far off
    assert routing_table(balanced, 64).shape[2] >= 2


def test_bad_load_is_a_clear_error():
    with pytest.raises(ValueError, match=r"load must be a tensor \[layers, experts\], got torch.Size\(\[4\]\)"):
        balanced_placement(torch.ones(4), 2, 2)
    with pytest.raises(ValueError, match="load must be finite and non-negative"):
        balanced_placement(torch.tensor([[1.0, -1.0]]), 2, 1)
    with pytest.raises(
        ValueError, match=r"2 ranks x 1 slots = 2 slots cannot hold 3 experts; use at least 2 slots per rank"
    ):
        balanced_placement(torch.ones(1, 3), 2, 1)
    with pytest.raises(ValueError, match="4 slots per rank exceed the 3 experts"):
        balanced_placement(torch.ones(1, 3), 2, 4)


@settings(max_examples=200)
@given(load_case(), st.integers(0, 2**16))
def test_with_the_previous_placement_copies_stay_and_no_rank_holds_an_expert_twice(case, seed):
    load, ranks, slots = case
    previous = balanced_placement(load, ranks, slots)
    assert torch.equal(balanced_placement(load, ranks, slots, previous=previous), previous)  # same load: nothing moves
    shifted = load[:, torch.randperm(load.shape[1], generator=torch.Generator().manual_seed(seed))]
    new = balanced_placement(shifted, ranks, slots, previous=previous)
    validate_placement(new, load.shape[1], num_ranks=ranks)
    for li in range(load.shape[0]):
        for r in range(ranks):
            assert len(set(new[li, r].tolist())) == slots, new[li, r]
        fresh = balanced_placement(shifted[li : li + 1], ranks, slots)[0]
        assert torch.equal(
            torch.bincount(new[li].flatten(), minlength=load.shape[1]),
            torch.bincount(fresh.flatten(), minlength=load.shape[1]),
        )  # same copy counts


def test_a_small_load_shift_moves_few_experts_with_the_previous_placement():
    g = torch.Generator().manual_seed(0)
    load = torch.rand(4, 64, generator=g) ** 6 * 1000
    shifted = load.clone()
    shifted[:, :6] = shifted[:, :6].flip(1) * 3  # ~10% of the experts change load
    previous = balanced_placement(load, 4, 18)
    kept = plan_rebalance(previous, balanced_placement(shifted, 4, 18, previous=previous), 64).experts_moved()
    scratch = plan_rebalance(previous, balanced_placement(shifted, 4, 18), 64).experts_moved()
    assert kept * 3 < scratch, (kept, scratch)


def test_previous_placement_of_another_shape_is_an_error():
    with pytest.raises(ValueError, match=r"previous placement has shape \(1, 2, 2\) but the new one is \(1, 2, 3\)"):
        balanced_placement(torch.ones(1, 3), 2, 3, previous=torch.tensor([[[0, 1], [2, 0]]]))
