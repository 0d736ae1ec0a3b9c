"""The byte counter and the lower bound the peers and the reshard tests check against: known counts on hand-made
collectives, the lower bound by hand, and a wasteful exchange (DTensor's Shard(0) -> Shard(1) on gloo, an
all-gather) that the counter finds above the lower bound, beside ``reshard`` on the same move, found at it."""

import torch

from benchmarks.counting import Need, ReceivedBytes, need_of_ids, need_of_layouts
from functional_npu import Mesh, replicated, sharded


def _collectives(ctx):
    """Each collective once, on 2 ranks, with this rank's count; rank r's tensor is [4, 4] float32 (64 bytes)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    g = ctx.mesh({"tp": 2}).group_name("tp")
    x = torch.arange(16.0).reshape(4, 4) + 100 * ctx.rank
    # rank 0 keeps 1 row and sends 3, rank 1 sends 2 and keeps 2: rank 0 receives 2 rows, rank 1 receives 3
    sends, recvs = ([1, 3], [1, 2]) if ctx.rank == 0 else ([2, 2], [3, 2])
    cases = {
        "all_to_all_single uneven": lambda: funcol.all_to_all_single(x, recvs, sends, g),
        "all_gather": lambda: funcol.all_gather_single(x, 0, g),
        "broadcast from 1": lambda: funcol.broadcast(x, 1, g),
        "reduce_scatter": lambda: funcol.reduce_scatter_tensor(x, "sum", 0, g),
        "all_reduce": lambda: funcol.all_reduce(x, "sum", g),
        "dist.all_to_all_single": lambda: dist.all_to_all_single(torch.empty(4, 4), x),
        "dist.all_gather": lambda: dist.all_gather([torch.empty(4, 4), torch.empty(4, 4)], x),
        "dist.broadcast from 0": lambda: dist.broadcast(x.clone(), 0),
    }
    out = {}
    for name, fn in cases.items():
        with ReceivedBytes() as counted:
            y = fn()
            getattr(y, "wait", lambda: None)()
        out[name] = (counted.received, counted.collectives)
    try:
        with ReceivedBytes():
            dist.reduce(x.clone(), 0)
    except NotImplementedError as e:
        out["reduce"] = str(e)
    return out


def test_the_counter_counts_what_each_collective_brings_from_the_other_ranks(world2):
    row = 4 * 4
    want = [
        {
            "all_to_all_single uneven": 2 * row,
            "all_gather": 64,
            "broadcast from 1": 64,
            "reduce_scatter": 2 * row,
            "all_reduce": 64,  # the convention: 2 (n - 1) / n of the buffer
            "dist.all_to_all_single": 2 * row,
            "dist.all_gather": 64,
            "dist.broadcast from 0": 0,
        },
        {
            "all_to_all_single uneven": 3 * row,
            "all_gather": 64,
            "broadcast from 1": 0,
            "reduce_scatter": 2 * row,
            "all_reduce": 64,
            "dist.all_to_all_single": 2 * row,
            "dist.all_gather": 64,
            "dist.broadcast from 0": 64,
        },
    ]
    for rank, got in enumerate(world2.run(_collectives)):
        assert got.pop("reduce").startswith("ReceivedBytes: no rule for c10d.reduce_"), rank  # nothing uncounted
        assert got == {k: (v, 1) for k, v in want[rank].items()}, rank


def test_the_lower_bound_by_hand():
    mesh = Mesh.abstract({"tp": 2})
    shapes = {"w": ((4, 4), torch.float32), "b": ((6,), torch.bfloat16)}
    rows, cols = {"w": sharded(0, "tp"), "b": sharded(0, "tp")}, {"w": sharded(1, "tp"), "b": replicated()}
    # w: rank r needs 8 elements (its columns), holds 4 of them (its rows); b: needs all 6, holds 3
    assert [need_of_layouts(shapes, rows, cols, mesh, r) for r in range(2)] == [Need(4 * 4 + 3 * 2, 4 * 4 + 3 * 2)] * 2
    assert need_of_layouts(shapes, cols, cols, mesh, 1) == Need(0, 8 * 4 + 6 * 2)
    assert need_of_ids([torch.tensor([1, 2])], [torch.tensor([[2, 3], [3, 4]])], 8) == Need(2 * 8, 8)


def _wasteful(ctx):
    """DTensor's Shard(0) -> Shard(1) and reshard's, on [8, 4] float32: (counted, lower bound) for each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from functional_npu import reshard, shard

    mesh = ctx.mesh({"tp": 2})
    full = torch.arange(32.0).reshape(8, 4)
    src, dst = {"w": sharded(0, "tp")}, {"w": sharded(1, "tp")}
    need = need_of_layouts({"w": ((8, 4), torch.float32)}, src, dst, mesh, ctx.rank).missing
    dm = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dt = distribute_tensor(full, dm, [Shard(0)])
    local = shard({"w": full}, src, mesh)
    reshard(local, src, dst, mesh)  # the process group exists before counting
    with ReceivedBytes() as theirs:
        a = dt.redistribute(dm, [Shard(1)]).to_local()
    with ReceivedBytes() as ours:
        b = reshard(local, src, dst, mesh)["w"]
    assert torch.equal(a, b) and torch.equal(b, shard({"w": full}, dst, mesh)["w"])
    return (theirs.received, need), (ours.received, need)


def test_a_wasteful_exchange_is_counted_above_the_lower_bound(world2):
    for (theirs, need), (ours, _) in world2.run(_wasteful):
        assert need == 4 * 2 * 4  # a rank needs 16 elements (its 2 columns) and holds 8 (its 4 rows)
        assert theirs == 16 * 4 != need  # DTensor on gloo all-gathers, then keeps its columns: every row it lacks
        assert ours == need
