"""Functional collectives over named axes on 4 gloo ranks (mesh dp=2 x tp=2), eager and compiled."""

import pytest
import torch

from functional_npu import Mesh, all_reduce, broadcast, permute

from ..support.workers import collectives_program, x_of

AXES = {"dp": 2, "tp": 2}


def expected(rank: int) -> dict[str, torch.Tensor]:
    mesh = Mesh.abstract(AXES, rank)
    xs = {r: x_of(r) for r in range(mesh.size)}
    tp_group, dp_group = mesh.group_ranks("tp"), mesh.group_ranks("dp")
    i = mesh.axis_index("tp")
    ar_tp = sum(xs[r] for r in tp_group)
    a2a_in = {r: xs[r].flatten()[:3].unsqueeze(1) for r in tp_group}
    return {
        "ar_tp": ar_tp,
        "ar_all_max": torch.stack(list(xs.values())).amax(0),
        "ag_dp_dim1": torch.cat([xs[r] for r in dp_group], dim=1),
        "rs_tp_dim1": ar_tp.chunk(2, dim=1)[i],
        "a2a": torch.cat([xs[r].chunk(2, dim=1)[i] for r in tp_group], dim=0),
        "bc_dp": xs[dp_group[1]],
        "perm": xs[(rank - 1) % mesh.size],
        # source j sends its rows [sum(1..i), +i+1) to index i
        "a2a_uneven": torch.cat([a2a_in[r][sum(range(1, i + 1)) : sum(range(1, i + 2))] for r in tp_group]),
    }


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
def test_collectives_match_reference(world4, use_compile):
    results = world4.run(collectives_program, AXES, use_compile)
    for rank, (out, ops) in enumerate(results):
        for name, want in expected(rank).items():
            assert torch.equal(out[name], want), (rank, name, out[name], want)
        if use_compile:
            census = {op: ops.count(op) for op in set(ops) if "_c10d_functional" in op}
            assert census == {
                "_c10d_functional.all_reduce": 2,
                "_c10d_functional.all_gather_into_tensor": 1,
                "_c10d_functional.reduce_scatter_tensor": 1,
                "_c10d_functional.all_to_all_single": 3,  # all_to_all, permute, uneven all_to_all
                "_c10d_functional.broadcast": 1,
                "_c10d_functional.wait_tensor": 8,
            }, census


def test_size_one_axis_is_identity_and_emits_nothing():
    mesh = Mesh.abstract({"dp": 1, "tp": 1}, 0)  # abstract: any real collective would raise
    x = torch.randn(3)
    assert all_reduce(x, mesh, "tp") is x
    assert broadcast(x, mesh, ("dp", "tp")) is x
    assert permute(x, mesh, "dp", [0]) is x


def test_collective_on_abstract_mesh_is_a_clear_error():
    with pytest.raises(
        RuntimeError, match=r"mesh \{'tp': 2\} is abstract \(no process group\): collectives need a mesh from make_mesh"
    ):
        all_reduce(torch.ones(2), Mesh.abstract({"tp": 2}, 0), "tp")


def test_collective_argument_errors():
    mesh = Mesh.abstract({"dp": 2, "tp": 2}, 0)
    with pytest.raises(ValueError, match=r"unknown mesh axis 'ep'; mesh axes are \{'dp': 2, 'tp': 2\}"):
        all_reduce(torch.ones(2), mesh, "ep")
    with pytest.raises(ValueError, match=r"axes \('tp', 'dp'\) must be given in mesh order; write \('dp', 'tp'\)"):
        all_reduce(torch.ones(2), mesh, ("tp", "dp"))
    with pytest.raises(ValueError, match=r"broadcast: src 2 is outside mesh axis 'tp' of size 2"):
        broadcast(torch.ones(2), mesh, "tp", src=2)
    with pytest.raises(ValueError, match=r"dst \[0, 0\] is not a permutation of range\(2\)"):
        permute(torch.ones(2), mesh, "tp", [0, 0])
    with pytest.raises(ValueError, match=r"reduce op 'mean' is not one of"):
        all_reduce(torch.ones(2), Mesh.abstract({"tp": 2}, 0), "tp", op="mean")
