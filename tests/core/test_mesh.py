"""Mesh: coordinates, split/flatten, group rank sets (single process), and real process groups (gloo)."""

import pytest
import torch
from hypothesis import given

from functional_npu import Mesh

from ..support.strategies import mesh_axes


def test_row_major_coordinates():
    mesh = Mesh.abstract({"dp": 2, "tp": 4})
    assert [mesh.at(r).coordinate for r in (0, 3, 6)] == [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 3}, {"dp": 1, "tp": 2}]
    assert mesh.at({"dp": 1, "tp": 2}).rank == 6
    assert mesh.at(6).axis_index(("dp", "tp")) == 6
    assert mesh.at(6).group_ranks("tp") == (4, 5, 6, 7)
    assert mesh.at(6).group_ranks("dp") == (2, 6)
    assert mesh.all_group_ranks("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert mesh.axis_size(("dp", "tp")) == 8


@given(mesh_axes(max_ranks=8))
def test_groups_partition_the_world_and_index_matches_group_position(axes):
    mesh = Mesh.abstract(axes)
    names = list(axes)
    for k in range(1, len(names) + 1):
        sub = tuple(names[:k]) if k % 2 else tuple(names[-k:])
        groups = mesh.all_group_ranks(sub)
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))
        assert all(len(g) == mesh.axis_size(sub) and list(g) == sorted(g) for g in groups)
        for r in range(mesh.size):
            m = mesh.at(r)
            assert m.group_ranks(sub)[m.axis_index(sub)] == r


def test_split_is_vllm_ascend_module_tp_over_dp():
    """seed 003: o_proj / lm_head TP groups are consecutive DP ranks; splitting dp keeps ranks in place."""
    mesh = Mesh.abstract({"dp": 4, "tp": 2})
    split = mesh.split("dp", ("dp_outer", "otp"), (2, 2))
    assert split.shape == {"dp_outer": 2, "otp": 2, "tp": 2}
    assert split.all_group_ranks("otp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    for r in range(8):
        assert split.at(r).group_ranks(("dp_outer", "otp")) == mesh.at(r).group_ranks("dp")


def _seed_module_tp_groups(pp, dp, tp, n):
    """seed 003's fine-grained TP groups (o_proj / lm_head / embedding / MLP), re-expressed: over a (pp, dp, tp)
    grid of ranks, each group is ``n`` consecutive DP ranks at one pp stage and one TP index."""
    grid = torch.arange(pp * dp * tp).reshape(pp, dp, tp)
    return sorted(
        tuple(grid[s, c * n : (c + 1) * n, t].tolist()) for s in range(pp) for c in range(dp // n) for t in range(tp)
    )


def _seed_flashcomm2_groups(dp, pp, tp, otp):
    """seed 003's flashcomm2 groups over a (dp, pp, tp) grid: o_proj TP groups of ``otp`` ranks strided by
    ``tp / otp`` inside each TP group, and the "odp" groups of the ranks at one position in them."""
    groups = tp // otp
    otp_groups, odp_groups = [], {}
    for base in range(0, dp * pp * tp, tp):
        for i in range(groups):
            ranks = [base + i + j * groups for j in range(otp)]
            otp_groups.append(tuple(ranks))
            for j, r in enumerate(ranks):
                odp_groups.setdefault((base, j), []).append(r)
    return sorted(otp_groups), sorted(tuple(g) for g in odp_groups.values())


def _seed_shard_weight_groups(module_groups, world):
    """seed 003's layer-sharding group for a module-TP'd weight (pp = 1): the ranks at one position of
    their module TP group, across all such groups."""
    by_position = torch.tensor(module_groups).T  # [group size, groups]
    return sorted(tuple(row.tolist()) for row in by_position.reshape(-1, world // by_position.shape[0]))


@pytest.mark.parametrize("pp, dp, tp, n", [(1, 4, 1, 2), (1, 4, 2, 2), (1, 8, 2, 4), (2, 4, 2, 2), (1, 6, 1, 3)])
def test_module_tp_groups_are_a_split_of_dp(pp, dp, tp, n):
    mesh = Mesh.abstract({"pp": pp, "dp": dp, "tp": tp}).split("dp", ("dp_outer", "otp"), (dp // n, n))
    assert sorted(mesh.all_group_ranks("otp")) == _seed_module_tp_groups(pp, dp, tp, n)


@pytest.mark.parametrize("dp, tp, otp", [(1, 4, 2), (2, 4, 2), (2, 8, 4), (1, 8, 2), (4, 2, 2)])
def test_flashcomm2_groups_are_a_split_of_tp(dp, tp, otp):
    """flashcomm2's o_proj TP inside the TP group is the major part of tp (strided ranks); "odp" the minor."""
    mesh = Mesh.abstract({"dp": dp, "tp": tp}).split("tp", ("fc2_otp", "fc2_odp"), (otp, tp // otp))
    want_otp, want_odp = _seed_flashcomm2_groups(dp, 1, tp, otp)
    assert sorted(mesh.all_group_ranks("fc2_otp")) == want_otp
    assert sorted(mesh.all_group_ranks("fc2_odp")) == want_odp


@pytest.mark.parametrize("dp, tp, otp", [(2, 4, 2), (4, 2, 2), (2, 8, 4)])
def test_layer_sharding_a_module_tp_weight_runs_over_the_axes_it_is_replicated_on(dp, tp, otp):
    """seed 003's shard-weight group for a flashcomm2 o_proj: every axis but the module's TP axis."""
    mesh = Mesh.abstract({"dp": dp, "tp": tp}).split("tp", ("fc2_otp", "fc2_odp"), (otp, tp // otp))
    want = _seed_shard_weight_groups(_seed_flashcomm2_groups(dp, 1, tp, otp)[0], dp * tp)
    assert sorted(mesh.all_group_ranks(("dp", "fc2_odp"))) == want
    # and for the standard TP group: the dp ranks at one tp index
    plain = Mesh.abstract({"dp": dp, "tp": tp})
    tp_groups = [tuple(range(r, r + tp)) for r in range(0, dp * tp, tp)]
    assert sorted(plain.all_group_ranks("dp")) == _seed_shard_weight_groups(tp_groups, dp * tp)


def test_flatten_is_ep_over_dp_and_tp():
    mesh = Mesh.abstract({"pp": 2, "dp": 2, "tp": 2})
    flat = mesh.flatten(("dp", "tp"), "ep")
    assert flat.shape == {"pp": 2, "ep": 4}
    for r in range(8):
        assert flat.at(r).group_ranks("ep") == mesh.at(r).group_ranks(("dp", "tp"))


def test_mesh_is_immutable_and_printable():
    mesh = Mesh.abstract({"dp": 2, "tp": 2}, 3)
    with pytest.raises(AttributeError):
        mesh.rank = 0  # type: ignore[misc]
    assert repr(mesh) == "Mesh(abstract {'dp': 2, 'tp': 2}, rank=3 {'dp': 1, 'tp': 1})"
    assert mesh == Mesh.abstract({"dp": 2, "tp": 2}, 3)


def test_mesh_errors():
    mesh = Mesh.abstract({"dp": 2, "tp": 4})
    with pytest.raises(
        ValueError,
        match=r"cannot split mesh axis 'dp' \(size 2\) into \('a', 'b'\) of sizes \(2, 2\): "
        r"the sizes must multiply to 2",
    ):
        mesh.split("dp", ("a", "b"), (2, 2))
    with pytest.raises(ValueError, match=r"split of 'dp': names \['tp'\] are already axes"):
        mesh.split("dp", ("tp", "b"), (1, 2))
    with pytest.raises(ValueError, match=r"flatten needs adjacent axes in mesh order; \('pp', 'tp'\) are not adjacent"):
        Mesh.abstract({"pp": 2, "dp": 1, "tp": 2}).flatten(("pp", "tp"), "x")
    with pytest.raises(ValueError, match=r"mesh axis 'tp' has size 0; sizes must be positive ints"):
        Mesh.abstract({"tp": 0})
    with pytest.raises(ValueError, match=r"mesh axis name '1x' must be an identifier"):
        Mesh.abstract({"1x": 2})
    with pytest.raises(ValueError, match=r"coordinate \{'dp': 0\} lacks axes \['tp'\]"):
        mesh.at({"dp": 0})
    with pytest.raises(ValueError, match=r"rank 8 is outside a mesh of 8 ranks"):
        mesh.at(8)
    with pytest.raises(ValueError, match=r"abstract mesh \{'dp': 2, 'tp': 4\} has no coordinate"):
        _ = mesh.coordinate


def test_make_mesh_needs_an_initialized_world():
    from functional_npu import make_mesh

    with pytest.raises(RuntimeError, match=r"make_mesh needs an initialized torch.distributed world"):
        make_mesh({"tp": 1})


# ---- real process groups -------------------------------------------------------------------------
def _groups_probe(ctx):
    from functional_npu import all_reduce

    mesh = ctx.mesh({"dp": 2, "tp": 2})
    split = mesh.split("dp", ("outer", "inner"), (1, 2))
    flat = mesh.flatten(("dp", "tp"), "world")
    dm = mesh.device_mesh()
    return {
        "coordinate": mesh.coordinate,
        "same_rank_set_same_group": split.group_name("inner") == mesh.group_name("dp"),
        "flatten_is_world": flat.group_name("world") == torch.distributed.group.WORLD.group_name,
        "tuple_equals_flatten": mesh.group_name(("dp", "tp")) == flat.group_name("world"),
        "device_mesh_names": dm.mesh_dim_names,
        "device_mesh_tp_group": dm.get_group("tp").group_name == mesh.group_name("tp"),
        "sum": all_reduce(torch.tensor([float(ctx.rank)]), split, "inner").item(),
        "groups_made": sorted(len(k) for k in mesh._groups.names),
    }


def _wrong_world(ctx):
    from functional_npu import make_mesh

    make_mesh({"dp": 3, "tp": 2})


def _group_created_while_tracing(ctx):
    mesh = ctx.mesh({"dp": 2, "tp": 2}).split("tp", ("a", "b"), (2, 1))

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        from functional_npu import all_reduce

        return all_reduce(x, mesh, ("dp", "a"))

    torch._dynamo.reset()
    return f(torch.ones(1))


def test_process_groups_are_shared_per_rank_set(world4):
    out = world4.run(_groups_probe)
    assert [o["coordinate"] for o in out] == [{"dp": d, "tp": t} for d in range(2) for t in range(2)]
    for o in out:
        assert o["same_rank_set_same_group"] and o["flatten_is_world"] and o["tuple_equals_flatten"]
        assert o["device_mesh_names"] == ("dp", "tp") and o["device_mesh_tp_group"]
        assert o["groups_made"] == [2, 2, 4]  # dp, tp and the world: a split reuses dp's group
    assert [o["sum"] for o in out] == [2.0, 4.0, 2.0, 4.0]


def test_make_mesh_rejects_wrong_world_size(world4):
    from functional_npu.runtime.launch import RemoteError

    with pytest.raises(
        RemoteError,
        match=r"mesh axes \{'dp': 3, 'tp': 2\} hold 6 ranks but the world has 4; choose sizes whose product is 4",
    ):
        world4.run(_wrong_world)


def test_group_creation_while_tracing_is_a_clear_error(world4):
    from functional_npu.runtime.launch import RemoteError

    with pytest.raises(
        RemoteError,
        match=r"the process group for mesh axes \('dp', 'a'\) does not exist yet "
        r"and cannot be created while tracing; call mesh.init_groups",
    ):
        world4.run(_group_created_while_tracing)
