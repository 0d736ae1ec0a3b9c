"""The DTensor bridge: every placement combination on 2x2 meshes against torch's own DTensor (gloo, 4 ranks), and
the placements with no layout refused by name."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from functional_npu import Layout
from functional_npu import Shard as LShard
from functional_npu.core.dtensor import layout_from_placements, placements_of

from ..support.dtensor_workers import SHAPE, dtensor_round_trip, placement_combinations

MESH = {"dp": 2, "tp": 2}


def _expected(placements):
    """Tensor dim d is cut over the mesh axes that shard it, in mesh order; a strided shard cuts after them."""
    axes = {0: [], 1: []}
    for name, p in zip(MESH, placements):
        if p.is_shard() or isinstance(p, _StridedShard):
            axes[p.dim].append(name)
    if isinstance(placements[0], _StridedShard):
        axes[placements[0].dim].reverse()
    dims = [LShard(tuple(axes[d])) if axes[d] else None for d in (0, 1)]
    while dims and dims[-1] is None:
        dims.pop()
    return Layout(tuple(dims))


@pytest.mark.parametrize("placements", placement_combinations(), ids=str)
def test_each_placement_combination_is_a_layout(placements):
    assert layout_from_placements(placements, MESH, SHAPE) == _expected(placements)


def test_placements_with_no_layout_are_refused_by_name():
    with pytest.raises(ValueError, match=r"w: placement P\(sum\) on mesh dim 1 \('tp'\) is a pending reduction"):
        layout_from_placements([Replicate(), Partial()], MESH, SHAPE, path="w")
    with pytest.raises(ValueError, match=r"w: dim 1 \(size 6\) is sharded over mesh axes \('dp', 'tp'\) \(size 4\)"):
        layout_from_placements([Shard(1), Shard(1)], MESH, (4, 6), path="w")
    with pytest.raises(
        ValueError, match=r"w: placement _S\(0, 3\) on mesh dim 0 \('dp'\): split factor 3 is no product"
    ):
        layout_from_placements([_StridedShard(0, split_factor=3), Shard(0)], MESH, SHAPE, path="w")
    from functional_npu import Mesh, cyclic, fused

    mesh = Mesh.abstract(MESH)
    with pytest.raises(ValueError, match=r"w: dim 0's layout cyclic\(dp, 4 layers\) has no DTensor placement"):
        placements_of(cyclic(0, "dp", 4), mesh, path="w")
    with pytest.raises(ValueError, match=r"has no DTensor placement"):
        placements_of(fused(0, [("gate", 2), ("up", 2)], "tp"), mesh, path="w")


def test_every_combination_on_a_2x2_mesh_matches_dtensor(world4):
    for rank, out in enumerate(world4.run(dtensor_round_trip)):
        assert out.pop("mesh") == (("dp", "tp"), (2, 2), True)
        for placements, r in out.items():
            where = f"rank {rank}, {placements}"
            assert r["same_local"] and r["placements_back"] and r["full_back"], (where, r)


@st.composite
def _shard_orders(draw):
    """A mesh of 1 to 3 dims and, for a 3-D tensor, each dim's mesh dims in the order they cut (sizes from 2: a
    size-1 dim cuts nothing, so any order of it is the same layout)."""
    sizes = draw(st.lists(st.integers(2, 4), min_size=1, max_size=3))
    owner = [draw(st.sampled_from([None, 0, 1, 2])) for _ in sizes]
    order = {}
    for d in range(3):
        on = [i for i, o in enumerate(owner) if o == d]
        if on:
            order[d] = tuple(draw(st.permutations(on)))
    return sizes, order


@given(_shard_orders())
def test_cut_orders_agree_with_dtensor_split_factors(case):
    """Any cut order over any mesh: ``placements_of`` gives the placements torch's own conversion from that shard
    order gives, and ``layout_from_placements`` reads torch's placements back to the same layout (torch's
    inverse agrees)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry

    from functional_npu import Mesh

    sizes, order = case
    names = [f"m{i}" for i in range(len(sizes))]
    mesh = Mesh.abstract(dict(zip(names, sizes)))
    shape = (64 * 27, 64 * 27, 64 * 27)  # any product of sizes 2 to 4 divides it
    layout = Layout(tuple(LShard(tuple(names[i] for i in order[d])) if d in order else None for d in range(3)))
    layout = Layout(tuple(layout.dims[: max(order, default=-1) + 1]))
    shard_order = tuple(ShardOrderEntry(d, order[d]) for d in sorted(order))
    plain = tuple(
        Shard(next(d for d in order if i in order[d])) if i in sum(order.values(), ()) else Replicate()
        for i in range(len(sizes))
    )
    torch_placements = DTensorSpec._convert_shard_order_to_StridedShard(shard_order, plain, _Sizes(sizes))
    assert placements_of(layout, mesh) == torch_placements
    assert layout_from_placements(torch_placements, mesh.shape, shape) == layout
    back = DTensorSpec._maybe_convert_StridedShard_to_shard_order(torch_placements, _Sizes(sizes))
    assert {e.tensor_dim: e.mesh_dims for e in back} == order
    assert layout_from_placements(plain, mesh.shape, shape, shard_order=shard_order) == layout


class _Sizes:
    """The one thing DTensor's shard-order conversions ask of a mesh."""

    def __init__(self, sizes):
        self.sizes = sizes

    def size(self, i):
        return self.sizes[i]
