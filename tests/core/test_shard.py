"""shard / unshard / local_shape: properties over random meshes and layouts, and every error path."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from functional_npu import Block, Layout, LayoutError, Mesh, fused, local_shape, replicated, shard, sharded, unshard
from functional_npu.core.layout import Cyclic, Shard
from functional_npu.core.tree import flatten_with_paths

from ..support.strategies import leaf_case, make_tensor, mesh_axes


@st.composite
def tree_case(draw):
    axes = draw(mesh_axes(max_ranks=8))
    leaves = draw(st.lists(leaf_case(axes), min_size=1, max_size=4))
    seed = draw(st.integers(0, 2**20))
    tree = {f"w{i}": make_tensor(shape, dtype, seed + i) for i, (shape, dtype, _) in enumerate(leaves)}
    specs = {f"w{i}": lay for i, (_, _, lay) in enumerate(leaves)}
    return Mesh.abstract(axes), tree, specs


@given(tree_case())
def test_shard_every_coordinate_then_unshard_is_identity(case):
    mesh, tree, specs = case
    locals_ = [shard(tree, specs, mesh, coordinate=r) for r in range(mesh.size)]
    back = unshard(locals_, specs, mesh)
    for (p, a), (_, b) in zip(flatten_with_paths(back), flatten_with_paths(tree)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), p


@given(tree_case())
def test_local_shapes_agree_with_local_shape(case):
    mesh, tree, specs = case
    for r in range(mesh.size):
        local = shard(tree, specs, mesh, coordinate=r)
        for path, x in tree.items():
            assert tuple(local[path].shape) == local_shape(x.shape, specs[path], mesh, coordinate=r, dtype=x.dtype)


@given(tree_case())
def test_shard_is_pure_and_never_aliases(case):
    mesh, tree, specs = case
    before = {k: v.clone() for k, v in tree.items()}
    local = shard(tree, specs, mesh, coordinate=mesh.size - 1)
    for k, v in tree.items():
        assert torch.equal(v.view(torch.uint8), before[k].view(torch.uint8))
        assert local[k].untyped_storage().data_ptr() != v.untyped_storage().data_ptr() or local[k].numel() == 0


def test_spec_tree_may_be_a_prefix():
    tree = {"layers": {"0": {"w": torch.randn(4, 2), "b": torch.randn(4)}}, "norm": torch.randn(3)}
    mesh = Mesh.abstract({"tp": 2})
    out = shard(tree, {"layers": sharded(0, "tp"), "norm": replicated()}, mesh, coordinate=1)
    assert torch.equal(out["layers"]["0"]["b"], tree["layers"]["0"]["b"][2:])
    assert torch.equal(out["norm"], tree["norm"])
    everything = shard(tree, replicated(), mesh, coordinate=0)  # one spec for the whole tree
    assert torch.equal(everything["norm"], tree["norm"])


def test_mesh_coordinate_or_explicit_coordinate():
    w = torch.arange(8.0)
    assert torch.equal(shard(w, sharded(0, "tp"), Mesh.abstract({"tp": 4}, {"tp": 2})), w[4:6])
    assert torch.equal(
        shard(w, sharded(0, ("dp", "tp")), Mesh.abstract({"dp": 2, "tp": 2}), coordinate={"dp": 1, "tp": 0}), w[4:6]
    )


# ---- errors: each names the path, dim, sizes, axis and a fix ------------------------------------
MESH = Mesh.abstract({"dp": 2, "tp": 4})


def test_error_indivisible_dim():
    with pytest.raises(
        LayoutError,
        match=r"specs\['layers.3.mlp.down'\] shards dim 1 \(size 4095\) over mesh axis 'tp' \(size 4\): "
        r"4 does not divide 4095; pad",
    ):
        shard({"layers": {"3": {"mlp": {"down": torch.zeros(2, 4095)}}}}, sharded(1, "tp"), MESH, coordinate=0)


def test_error_unknown_axis():
    with pytest.raises(
        LayoutError,
        match=r"specs\['w'\] dim 0 uses mesh axis 'ep', which the mesh \{'dp': 2, 'tp': 4\} does not have; "
        r"use one of \['dp', 'tp'\]",
    ):
        shard({"w": torch.zeros(8)}, {"w": sharded(0, "ep")}, MESH, coordinate=0)


def test_error_structure_mismatch_names_paths():
    with pytest.raises(ValueError, match=r"params with no spec \(1\): b(.|\n)*specs for paths not in params \(1\): c"):
        shard({"a": torch.zeros(2), "b": torch.zeros(2)}, {"a": replicated(), "c": replicated()}, MESH, coordinate=0)


def test_error_spec_rank_greater_than_tensor_rank():
    with pytest.raises(
        LayoutError,
        match=r"specs\['w'\] = Layout\(dim2=shard\(tp\)\) describes 3 dims but the tensor has 2 \(shape \(4, 4\)\)",
    ):
        shard({"w": torch.zeros(4, 4)}, {"w": sharded(2, "tp")}, MESH, coordinate=0)


def test_error_non_tensor_leaf():
    with pytest.raises(
        TypeError, match=r"params\['w'\] is a float, not a torch.Tensor; convert it with torch.as_tensor"
    ):
        shard({"w": 1.5}, {"w": replicated()}, MESH, coordinate=0)


def test_error_spec_is_not_a_layout():
    with pytest.raises(TypeError, match=r"specs\['w'\] is 0 \(int\); expected a Layout"):
        shard({"w": torch.zeros(4)}, {"w": 0}, MESH, coordinate=0)


def test_error_packed_dim_on_float_dtype():
    with pytest.raises(
        LayoutError,
        match=r"dim 0 is packed by 8 but the tensor dtype is torch.float32; "
        r"packed weights are stored in an integer dtype",
    ):
        shard({"w": torch.zeros(8)}, {"w": sharded(0, "tp", pack=8)}, MESH, coordinate=0)


def test_error_packed_shard_off_pack_boundary():
    with pytest.raises(
        LayoutError,
        match=r"block 'q': the shard at logical \[0, 4\) on coordinate 0 of mesh axis 'tp' \(size 4\) "
        r"does not fall on a stored-element boundary \(pack 8\)",
    ):
        shard(
            {"w": torch.zeros(2, dtype=torch.int32)},
            {"w": fused(0, [Block("q", 16)], "tp", pack=8)},
            MESH,
            coordinate=0,
        )


def test_error_axis_used_on_two_dims():
    with pytest.raises(LayoutError, match=r"uses mesh axis 'tp' on dim 0 and dim 1; an axis can shard one dim only"):
        shard({"w": torch.zeros(4, 4)}, {"w": Layout((Shard(("tp",)), Shard(("tp",))))}, MESH, coordinate=0)


def test_axes_out_of_mesh_order_cut_in_the_order_written():
    """``("tp", "dp")`` cuts over tp first, then each tp piece over dp: piece ``t * dp + d`` at (dp=d, tp=t)."""
    mesh = Mesh.abstract({"dp": 2, "tp": 3})
    w = torch.arange(12)
    for r in range(mesh.size):
        c = mesh.at(r).coordinate
        piece = c["tp"] * 2 + c["dp"]
        assert shard({"w": w}, {"w": sharded(0, ("tp", "dp"))}, mesh, coordinate=r)["w"].tolist() == [
            2 * piece,
            2 * piece + 1,
        ]


def test_error_block_sizes_do_not_sum_to_dim():
    with pytest.raises(
        LayoutError,
        match=r"fused from blocks \[gate:8, up:8\] of total size 16 but the tensor dim is 12; fix the block sizes",
    ):
        shard({"w": torch.zeros(12, 2)}, {"w": fused(0, [("gate", 8), ("up", 8)], "tp")}, MESH, coordinate=0)


def test_error_gqa_neither_divides():
    spec = fused(0, [Block("q", 8, 1), Block("k", 3, 1, replicate=True)], "tp")
    with pytest.raises(
        LayoutError,
        match=r"block 'k' has 3 units of 1 \(size 3\) sharded over mesh axis 'tp' \(size 4\): "
        r"either 4 divides 3 or 3 divides 4",
    ):
        shard({"w": torch.zeros(11)}, {"w": spec}, MESH, coordinate=0)


def test_error_fewer_units_than_ranks_without_replication():
    with pytest.raises(
        LayoutError,
        match=r"block 'q' has 2 units of 2 \(size 4\)(.|\n)*4 must divide 2(.|\n)*mark the block replicate=True",
    ):
        shard({"w": torch.zeros(4)}, {"w": fused(0, [Block("q", 4, 2)], "tp")}, MESH, coordinate=0)


def test_error_cyclic_size_mismatch():
    with pytest.raises(
        LayoutError, match=r"dim 0 is cyclic over 4 layers but the tensor has 6 \(shape \(6, 2\)\); set size=6"
    ):
        shard({"w": torch.zeros(6, 2)}, {"w": Layout((Cyclic("dp", 4),))}, MESH, coordinate=0)


def test_error_abstract_mesh_without_coordinate():
    with pytest.raises(ValueError, match=r"mesh \{'dp': 2, 'tp': 4\} is abstract with no coordinate: pass coordinate="):
        shard(torch.zeros(8), sharded(0, "tp"), MESH)


def test_error_coordinate_outside_mesh():
    with pytest.raises(ValueError, match=r"coordinate tp=4 is outside mesh axis 'tp' of size 4"):
        shard(torch.zeros(8), sharded(0, "tp"), MESH, coordinate={"dp": 0, "tp": 4})


def test_error_unshard_wrong_local_shape():
    mesh = Mesh.abstract({"tp": 2})
    locals_ = [torch.zeros(3), torch.zeros(4)]
    with pytest.raises(
        LayoutError,
        match=r"the local shards imply different full shapes or dtypes "
        r"\(rank 0: \(6,\) torch.float32, rank 1: \(8,\) torch.float32\)",
    ):
        unshard(locals_, sharded(0, "tp"), mesh)


def test_error_unshard_needs_every_rank():
    with pytest.raises(ValueError, match=r"unshard needs one local tree per rank of mesh \{'tp': 2\} \(2\), got 1"):
        unshard([torch.zeros(2)], sharded(0, "tp"), Mesh.abstract({"tp": 2}))
