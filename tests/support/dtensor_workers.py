"""Rank jobs for the DTensor bridge tests."""

import itertools

import torch

SHAPE = (4, 8)


def placement_combinations():
    """Every placement of a 2-D tensor on a 2x2 mesh: Replicate, Shard(0) or Shard(1) on each mesh dim, and the
    strided shard FSDP2 leaves on each dim (mesh dim 1 cuts first)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    plain = list(itertools.product([Replicate(), Shard(0), Shard(1)], repeat=2))
    return plain + [(_StridedShard(d, split_factor=2), Shard(d)) for d in (0, 1)]


def dtensor_round_trip(ctx):
    """For every combination on a 2x2 mesh: DTensor's local shard vs ``shard`` under the derived layout (bit for
    bit), the layout read back from the DTensor, and ``to_dtensor`` of our shard gathered by DTensor."""
    from torch.distributed.tensor import distribute_tensor

    from functional_npu import shard
    from functional_npu.core.dtensor import layout_from_dtensor, mesh_from_device_mesh, placements_of, to_dtensor

    mesh = ctx.mesh({"dp": 2, "tp": 2})
    dm = mesh.device_mesh()
    back = mesh_from_device_mesh(dm)
    full = torch.arange(32, dtype=torch.float32).reshape(SHAPE)
    out = {"mesh": (back.axis_names, back.axis_sizes, back.rank == mesh.rank)}
    for placements in placement_combinations():
        dt = distribute_tensor(full, dm, list(placements))
        layout = layout_from_dtensor(dt, path="w")
        ours = shard({"w": full}, {"w": layout}, mesh)["w"]
        again = to_dtensor(ours, layout, mesh, path="w")
        out[str(placements)] = {
            "layout": layout,
            "same_local": torch.equal(dt.to_local(), ours),
            "placements_back": tuple(placements_of(layout, mesh)) == tuple(placements),
            "full_back": torch.equal(again.full_tensor(), full),
        }
    return out
