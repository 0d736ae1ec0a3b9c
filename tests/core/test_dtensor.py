"""The DTensor bridge: every placement combination on 2x2 meshes against torch's own DTensor (gloo, 4 ranks), and
the placements with no layout refused by name."""

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from functional_npu import Layout
from functional_npu import Shard as LShard
from functional_npu.core.dtensor import layout_from_placements, placements_of

from ..support.dtensor_workers import SHAPE, dtensor_round_trip, placement_combinations

MESH = {"dp": 2, "tp": 2}


def _expected(placements):
    """Tensor dim d is cut over the mesh axes that shard it, in mesh order."""
    axes = {0: [], 1: []}
    for name, p in zip(MESH, placements):
        if p.is_shard():
            axes[p.dim].append(name)
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
    with pytest.raises(ValueError, match=r"strided shards \(FSDP2 over a tensor-parallel dim\)"):
        layout_from_placements([_StridedShard(0, split_factor=2), Shard(0)], MESH, SHAPE, path="w")
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
