"""reshard: plan properties for every rank in one process (against shard/unshard and a brute-force
byte count), real exchanges on 2 and 4 gloo ranks (eager and compiled), and every error path."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.counting import need_of_layouts
from functional_npu import (
    Block,
    Layout,
    LayoutError,
    Mesh,
    cyclic,
    fused,
    plan_reshard,
    replicated,
    reshard,
    shard,
    sharded,
    unshard,
)
from functional_npu.core.buckets import bucket_cost, slab_costs
from functional_npu.core.layout import Cyclic, Shard, validate
from functional_npu.core.reshard import simulate

from ..support.reshard_workers import reshard_case
from ..support.strategies import make_tensor, mesh_axes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


@st.composite
def dim_struct(draw):
    """A dim as fused blocks whose unit counts share a group count G (so every layout kind can fit)."""
    groups = draw(st.sampled_from([1, 2, 4]))
    unit = draw(st.integers(1, 2))
    blocks = []
    for i in range(draw(st.integers(1, 3))):
        units = groups * draw(st.sampled_from([1, 1, 2]))
        blocks.append((f"b{i}", units * unit, unit))
    return groups, blocks


@st.composite
def dim_spec(draw, struct, free: list[str], axes: dict[str, int]):
    """A spec for one dim of ``struct`` over some of the ``free`` axes (None if the draw does not fit)."""
    groups, blocks = struct
    use = [a for a in free if draw(st.booleans())]
    if not use:
        return None
    use = draw(st.permutations(use))  # any cut order (FSDP2's strided shards cut against the mesh)
    length = sum(size for _, size, _ in blocks)
    kind = draw(st.sampled_from(["shard", "fused", "grouped", "cyclic"]))
    if kind == "cyclic":
        return Cyclic(use[0], length, draw(st.integers(0, 3)))
    if kind == "shard":
        return Shard(tuple(use))
    bl = tuple(Block(name, size, unit, draw(st.booleans())) for name, size, unit in blocks)
    return Shard(tuple(use), bl, 1, groups if kind == "grouped" else 1)


@st.composite
def layout_for(draw, structs, axes: dict[str, int]):
    free = list(axes)
    dims = []
    shape = tuple(sum(s for _, s, _ in b) for _, b in structs)
    for d, struct in enumerate(structs):
        spec = draw(dim_spec(struct, free, axes))
        if spec is not None:
            try:
                validate("x", Layout((None,) * d + (spec,)), shape[: d + 1], torch.float32, axes)
            except LayoutError:
                spec = None
        if spec is not None:
            free = [a for a in free if a not in spec.axes]
        dims.append(spec)
    while dims and dims[-1] is None:
        dims.pop()
    return Layout(tuple(dims))


@st.composite
def reshard_leaf(draw, axes: dict[str, int]):
    structs = draw(st.lists(dim_struct(), min_size=1, max_size=3))
    shape = tuple(sum(s for _, s, _ in b) for _, b in structs)
    return shape, draw(st.sampled_from(DTYPES)), draw(layout_for(structs, axes)), draw(layout_for(structs, axes))


@st.composite
def reshard_tree(draw, world: int | None = None):
    axes = draw(mesh_axes(max_ranks=8, world=world))
    leaves = draw(st.lists(reshard_leaf(axes), min_size=1, max_size=4))
    return axes, leaves, draw(st.integers(0, 2**20))


def _setup(axes, leaves, seed):
    mesh = Mesh.abstract(axes)
    tree = {f"w{i}": make_tensor(shape, dtype, seed + i) for i, (shape, dtype, _, _) in enumerate(leaves)}
    src = {f"w{i}": a for i, (_, _, a, _) in enumerate(leaves)}
    dst = {f"w{i}": b for i, (_, _, _, b) in enumerate(leaves)}
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in tree.items()}
    return mesh, tree, src, dst, shapes


def _bits(x):
    return x.contiguous().view(torch.uint8)


@settings(max_examples=80)
@given(reshard_tree())
def test_plan_executes_to_shard_of_gather_and_round_trips_bit_for_bit(case):
    mesh, tree, src, dst, shapes = _setup(*case)
    locals_a = [shard(tree, src, mesh, coordinate=r) for r in range(mesh.size)]
    full = unshard(locals_a, src, mesh)  # gather_A, single-process
    out = simulate(locals_a, plan_reshard(shapes, src, dst, mesh))
    back = simulate(out, plan_reshard(shapes, dst, src, mesh))
    for r in range(mesh.size):
        want = shard(full, dst, mesh, coordinate=r)
        for k in tree:
            assert out[r][k].dtype == want[k].dtype and torch.equal(_bits(out[r][k]), _bits(want[k])), (r, k)
            assert torch.equal(_bits(back[r][k]), _bits(locals_a[r][k])), (r, k)


@settings(max_examples=80)
@given(reshard_tree())
def test_every_destination_byte_written_once_and_bytes_moved_equal_the_lower_bound(case):
    mesh, tree, src, dst, shapes = _setup(*case)
    plan = plan_reshard(shapes, src, dst, mesh)
    leaves = {leaf.path: leaf for leaf in plan.leaves}
    for r in range(mesh.size):
        counts = {k: torch.zeros(leaves[k].dst_shapes[r], dtype=torch.int32) for k in tree}
        for t in plan.transfers:
            if t.dst == r:
                view = counts[t.path]
                for d, (start, n) in enumerate(t.dst_box):
                    view = view.narrow(d, start, n)
                view += 1
        assert all(bool((c == 1).all()) for c in counts.values()), r
        # independent count (benchmarks.counting): which element ids does r hold before, and need after?
        need = need_of_layouts(shapes, src, dst, mesh, r)
        traffic = plan.traffic[r]
        assert traffic.received == traffic.lower_bound == need.missing
        assert traffic.local_copy == need.held
        # on the wire: the split sizes its all_to_all is given, each peer's section padded to 8 bytes
        program = plan.programs[r]
        wire = sum(n for peer, n in zip(program.group, program.recv_sizes) if peer != r)
        assert need.missing <= wire <= need.missing + 7 * (len(program.group) - 1)
    assert sum(t.sent for t in plan.traffic) == sum(t.received for t in plan.traffic)


def _wire(program) -> int:
    """Bytes a rank's buffers take for one program: its padded send plus receive sections (self excluded)."""
    return sum(program.send_sizes) + sum(program.recv_sizes)


def _row_costs(plan, path: str, rows: int) -> list[int]:
    """Brute force: what each dim-0 row of a leaf alone takes on its busiest rank."""
    moves = [t.move() for t in plan.transfers if t.path == path]
    return [max(bucket_cost(slab_costs(moves, i, i + 1)).values(), default=0) for i in range(rows)]


@settings(max_examples=60)
@given(reshard_tree(), st.floats(0.0, 1.0))
def test_buckets_cut_leaves_into_dim0_slabs_within_the_bound_and_execute_to_the_same_bits(case, share):
    """Buckets as small as one row of the costliest leaf allows: every leaf's rows once, in order, a leaf that fits
    a bucket alone whole; every bucket within the bound on every rank; the bytes received the lower bound plus the
    padding; the destination bits those of the one exchange."""
    mesh, tree, src, dst, shapes = _setup(*case)
    whole = plan_reshard(shapes, src, dst, mesh)
    rows = {p: shape[0] if shape else 1 for p, (shape, _) in shapes.items()}
    least = max([max(_row_costs(whole, p, n)) for p, n in rows.items()] + [1])
    most = max(_wire(p) for p in whole.programs)
    bucket = max(least, int(most * share))
    plan = plan_reshard(shapes, src, dst, mesh, bucket_bytes=bucket)
    slabs = [s for b in plan.slabs for s in b]
    assert [p for p, _, _ in slabs] == [p for p in tree for _ in range(sum(q == p for q, _, _ in slabs))]
    for p, n in rows.items():
        mine = [(a, b) for q, a, b in slabs if q == p]
        assert mine[0][0] == 0 and mine[-1][1] == n and all(x[1] == y[0] < y[1] for x, y in zip(mine, mine[1:]))
        alone = max(
            bucket_cost(slab_costs([t.move() for t in whole.transfers if t.path == p], 0, n)).values(), default=0
        )
        assert len(mine) == 1 or alone > bucket, (p, mine, alone, bucket)
    assert plan.bucket_paths == tuple(tuple(p for p, _, _ in b) for b in plan.slabs)
    for programs in plan.buckets:
        assert all(_wire(p) <= bucket for p in programs)
    # every byte moves once: per rank, the buckets' wire bytes are the lower bound plus the padding
    for r in range(mesh.size):
        got = sum(sum(n for peer, n in zip(b[r].group, b[r].recv_sizes) if peer != r) for b in plan.buckets)
        peers = len(plan.programs[r].group) - 1
        assert whole.traffic[r].lower_bound <= got <= whole.traffic[r].lower_bound + 7 * peers * len(plan.buckets)
    locals_a = [shard(tree, src, mesh, coordinate=r) for r in range(mesh.size)]
    for a, b in zip(simulate(locals_a, whole), simulate(locals_a, plan)):
        assert list(a) == list(b) and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def test_one_bucket_per_leaf_when_the_bound_is_one_leaf():
    # 4 float rows sharded over tp -> replicated: each rank sends 16 and receives 16 bytes per leaf
    mesh = Mesh.abstract({"tp": 2})
    shapes = {f"w{i}": ((8, 1), torch.float32) for i in range(3)}
    specs = dict.fromkeys(shapes, sharded(0, "tp")), dict.fromkeys(shapes, replicated())
    assert plan_reshard(shapes, *specs, mesh, bucket_bytes=32).bucket_paths == (("w0",), ("w1",), ("w2",))
    assert plan_reshard(shapes, *specs, mesh, bucket_bytes=64).bucket_paths == (("w0", "w1"), ("w2",))
    assert plan_reshard(shapes, *specs, mesh).bucket_paths == (("w0", "w1", "w2"),)


def test_a_leaf_bigger_than_the_bucket_is_cut_into_dim0_slabs():
    # small: each rank sends its 2 floats and receives the other 2 (8 + 8 bytes); big: rows 0-3 on rank 0, 4-7 on
    # rank 1, 256 bytes a row. At 512 bytes: small and one row of big (8 + 256 padded, + 8 on rank 0), then two
    # rows a bucket (rows 3 and 4: rank 0 sends one and receives one)
    mesh = Mesh.abstract({"tp": 2})
    shapes = {"small": ((4,), torch.float32), "big": ((8, 64), torch.float32)}
    src, dst = dict.fromkeys(shapes, sharded(0, "tp")), dict.fromkeys(shapes, replicated())
    plan = plan_reshard(shapes, src, dst, mesh, bucket_bytes=512)
    assert plan.slabs == (
        (("small", 0, 4), ("big", 0, 1)),
        (("big", 1, 3),),
        (("big", 3, 5),),
        (("big", 5, 7),),
        (("big", 7, 8),),
    )
    steps = [b[0].steps[-1] for b in plan.buckets]  # rank 0's steps for big: made in the first, handed in the last
    assert [(s.opens, s.closes) for s in steps] == [(True, False)] + [(False, False)] * 3 + [(False, True)]
    assert [s.window for s in steps] == [(0, 1), (1, 2), (3, 1), None, None]  # local source rows read; none after 4
    tree = {"small": torch.arange(4.0), "big": torch.randn(8, 64)}
    local = [shard(tree, src, mesh, coordinate=r) for r in range(2)]
    for out in simulate(local, plan):
        assert torch.equal(out["big"], tree["big"]) and torch.equal(out["small"], tree["small"])


def test_load_is_spread_over_replicas():
    # replicated source on 4 ranks, destination sharded over dp: every rank already holds its part
    mesh = Mesh.abstract({"dp": 2, "tp": 2})
    plan = plan_reshard({"w": ((8, 4), torch.float32)}, {"w": replicated()}, {"w": sharded(0, "dp")}, mesh)
    assert plan.axes == () and all(t.received == 0 for t in plan.traffic)
    # sharded over dp, replicated over tp -> replicated: each rank fetches from the holder in its own tp column
    plan = plan_reshard({"w": ((8, 4), torch.float32)}, {"w": sharded(0, "dp")}, {"w": replicated()}, mesh)
    assert plan.axes == ("dp",)
    assert [t.sent for t in plan.traffic] == [64] * 4


def test_megatron_grouped_qkv_to_canonical_moves_only_the_rows_that_change_rank():
    # 4 q heads, 2 KV groups, head_dim 2: Megatron tp=2 rank r holds group r = [q_2r, q_2r+1, k_r, v_r]
    blocks = [Block("q", 8, 2), Block("k", 4, 2, True), Block("v", 4, 2, True)]
    mesh = Mesh.abstract({"tp": 2})
    plan = plan_reshard(
        {"qkv": ((16, 3), torch.float32)},
        {"qkv": fused(0, blocks, "tp", groups=2)},
        {"qkv": fused(0, blocks, "tp")},
        mesh,
    )
    assert plan.axes == () and [t.local_copy for t in plan.traffic] == [8 * 3 * 4] * 2  # same heads, other order
    to_tp1 = plan_reshard(
        {"qkv": ((16, 3), torch.float32)}, {"qkv": fused(0, blocks, "tp", groups=2)}, {"qkv": replicated()}, mesh
    )
    assert [t.received for t in to_tp1.traffic] == [8 * 3 * 4] * 2 and [t.allgather_slice for t in to_tp1.traffic] == [
        8 * 3 * 4
    ] * 2


# ---- real exchanges on gloo ---------------------------------------------------------------------
CASES = {
    "grouped_qkv_to_gqa_tp": (
        (16, 3),
        torch.bfloat16,
        fused(0, [Block("q", 8, 2), Block("k", 4, 2), Block("v", 4, 2)], "tp", groups=2),
        fused(0, [Block("q", 8, 2), Block("k", 4, 2, True), Block("v", 4, 2, True)], "tp"),
    ),
    "stage_to_cyclic": ((4, 6), torch.float32, sharded(0, "tp"), cyclic(0, "tp", 4)),
    "row_to_column": ((4, 8), torch.float16, sharded(1, "tp"), sharded(0, "tp")),
    "sharded_to_replicated": ((6,), torch.int64, sharded(0, "tp"), replicated()),
}


def _check_remote(results, n_leaves, exact: bool = True):
    """Bits, round trip, source untouched, no aliasing; eagerly, the bytes each rank received, counted at the
    all_to_all, against its lower bound from element ids. Each peer's section of the exchange is padded to 8 bytes
    (so it views back as any dtype), so on the wire a rank may receive up to 7 bytes per peer more than it needs:
    ``exact`` cases are aligned (and move something), the others are held to that slack."""
    slack = 0 if exact else 7 * (len(results) - 1)
    for rank, (equal, round_trip, untouched, aliased, _, traffic) in enumerate(results):
        assert all(equal.values()) and len(equal) == n_leaves, equal
        assert all(round_trip.values()), round_trip
        assert untouched and not aliased
        for way, (counted, need) in (traffic or {}).items():
            assert need <= counted <= need + slack, (rank, way, counted, need)
        assert traffic is None or not exact or sum(need for _, need in traffic.values()) > 0, (rank, traffic)


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
def test_gloo_two_ranks(world2, use_compile):
    results = world2.run(reshard_case, {"tp": 2}, list(CASES.values()), 7, use_compile)
    _check_remote(results, len(CASES))
    if use_compile:
        ops = results[0][4]
        assert ops.count("_c10d_functional.all_to_all_single") == 2  # one exchange each way, every leaf bucketed


def test_gloo_compiled_with_planning_inside_the_graph(world2):
    leaves = [CASES["row_to_column"]]
    results = world2.run(reshard_case, {"tp": 2}, leaves, 5, True, planned=False)
    _check_remote(results, 1)
    assert results[0][4].count("_c10d_functional.all_to_all_single") == 2


def test_gloo_four_ranks_two_axes(world4):
    qkv = [Block("q", 16, 2), Block("k", 4, 2, True), Block("v", 4, 2, True)]
    leaves = [
        ((24, 3), torch.float32, fused(0, qkv, "tp", groups=2), fused(0, qkv, ("dp", "tp"))),  # GQA replication at 4
        ((4, 2, 4), torch.bfloat16, Layout((Shard(("dp",)), None, Shard(("tp",)))), cyclic(0, "tp", 4)),
        ((8, 4), torch.float32, replicated(), sharded(1, ("dp", "tp"))),
    ]
    _check_remote(world4.run(reshard_case, {"dp": 2, "tp": 2}, leaves, 3, False), len(leaves))


def test_gloo_each_peers_section_is_padded_to_8_bytes_on_the_wire(world4):
    """4 floats sharded over 4 ranks, to replicated: each rank needs 3 (12 bytes), one from each peer, and receives
    3 sections of 4 bytes each padded to 8: 24 bytes counted at the all_to_all."""
    leaves = [((4,), torch.float32, sharded(0, "tp"), replicated())]
    for *_, traffic in world4.run(reshard_case, {"tp": 4}, leaves, 0, False):
        assert traffic == {"there": (24, 12), "back": (0, 0)}


@settings(max_examples=6)
@given(case=reshard_tree(world=4))
def test_gloo_random_layouts_four_ranks(world4, case):
    axes, leaves, seed = case
    _check_remote(world4.run(reshard_case, axes, leaves, seed, False), len(leaves), exact=False)


# ---- errors: named, raised before any byte moves --------------------------------------------------
MESH = Mesh.abstract({"tp": 2}, 0)


def test_error_destination_does_not_fit():
    with pytest.raises(
        LayoutError, match=r"specs\['w'\] shards dim 1 \(size 3\) over mesh axis 'tp' \(size 2\): 2 does not divide 3"
    ):
        reshard({"w": torch.zeros(2, 3)}, sharded(0, "tp"), sharded(1, "tp"), MESH)


def test_error_local_shard_of_another_layout():
    with pytest.raises(
        LayoutError,
        match=r"params\['w'\] has local shape \(3,\) but Layout\(dim0=shard\(tp \[a:2\|b:6\]\)\) on mesh \{'tp': 2\}",
    ):
        reshard({"w": torch.zeros(3)}, fused(0, [("a", 2), ("b", 6)], "tp"), replicated(), MESH)


def test_error_grouped_qkv_groups_not_divisible_by_tp():
    spec = fused(0, [Block("q", 6, 1), Block("k", 3, 1), Block("v", 3, 1)], "tp", groups=3)
    with pytest.raises(
        LayoutError,
        match=r"dim 0 has 3 interleaved groups sharded over mesh axis 'tp' \(size 2\): "
        r"2 must divide 3; use an axis size",
    ):
        reshard({"w": torch.zeros(6)}, spec, replicated(), MESH)


def test_error_groups_without_blocks():
    with pytest.raises(LayoutError, match=r"has groups=2 but no blocks"):
        reshard({"w": torch.zeros(4)}, Layout((Shard(("tp",), (), 1, 2),)), replicated(), MESH)


def test_error_specs_do_not_cover_the_tree():
    with pytest.raises(ValueError, match=r"params with no spec \(1\): b"):
        reshard({"a": torch.zeros(2), "b": torch.zeros(2)}, replicated(), {"a": replicated()}, MESH)


def test_error_non_tensor_leaf():
    with pytest.raises(TypeError, match=r"params\['w'\] is a float, not a torch.Tensor"):
        reshard({"w": 1.5}, replicated(), replicated(), MESH)


def test_error_plan_for_another_tree_or_mesh():
    plan = plan_reshard(
        {"w": ((4,), torch.float32)}, {"w": replicated()}, {"w": sharded(0, "tp")}, Mesh.abstract({"tp": 2})
    )
    with pytest.raises(
        ValueError,
        match=r"params\['w'\] is \(6,\) torch.float32 on rank 0 "
        r"but the plan expects \(4,\) torch.float32 for replicated\(\)",
    ):
        reshard({"w": torch.zeros(6)}, replicated(), sharded(0, "tp"), MESH, plan=plan)
    with pytest.raises(
        ValueError,
        match=r"the plan was made for params\['w'\] going replicated\(\) -> Layout\(dim0=shard\(tp\)\), but these "
        r"params go replicated\(\) -> replicated\(\); plan again",
    ):
        reshard({"w": torch.zeros(4)}, replicated(), replicated(), MESH, plan=plan)
    with pytest.raises(ValueError, match=r"made for another tree: it lacks the tree's 1 leaves \(v\); plan again"):
        reshard({"w": torch.zeros(4), "v": torch.zeros(4)}, replicated(), replicated(), MESH, plan=plan)
    two = {"w": ((4,), torch.float32), "v": ((4,), torch.float32)}
    both = plan_reshard(
        two, dict.fromkeys(two, replicated()), dict.fromkeys(two, sharded(0, "tp")), Mesh.abstract({"tp": 2})
    )
    with pytest.raises(ValueError, match=r"made for another tree: it has 1 leaves \(v\) the tree does not; plan"):
        reshard({"w": torch.zeros(4)}, replicated(), sharded(0, "tp"), MESH, plan=both)
    with pytest.raises(ValueError, match=r"it orders the same leaves otherwise \(at #0: 'w', the tree 'v'\)"):
        # before: "the plan covers leaves [] differently", the same leaves in another order
        reshard({"v": torch.zeros(4), "w": torch.zeros(4)}, replicated(), sharded(0, "tp"), MESH, plan=both)
    with pytest.raises(ValueError, match=r"the plan is for mesh \{'tp': 2\} but the mesh is \{'dp': 1, 'tp': 2\}"):
        reshard({"w": torch.zeros(4)}, replicated(), sharded(0, "tp"), Mesh.abstract({"dp": 1, "tp": 2}, 0), plan=plan)


@pytest.mark.parametrize("bad", [0, -4096])
def test_error_bucket_bytes_not_positive(bad):
    with pytest.raises(ValueError, match=rf"reshard: bucket_bytes must be positive .*, got {bad}; pass None for one"):
        reshard({"w": torch.zeros(4)}, sharded(0, "tp"), replicated(), MESH, bucket_bytes=bad)
    with pytest.raises(TypeError, match=r"reshard: bucket_bytes must be an int .* or None, got float"):
        plan_reshard({"w": ((4,), torch.float32)}, {"w": replicated()}, {"w": replicated()}, MESH, bucket_bytes=1.5)


def test_error_bucket_below_one_row_of_a_leaf_names_it_both_sizes_and_the_least_bucket():
    shapes = {"small": ((4,), torch.float32), "big": ((8, 64), torch.float32)}
    src, dst = dict.fromkeys(shapes, sharded(0, "tp")), dict.fromkeys(shapes, replicated())
    # one row of big is 256 bytes, sent by the rank that holds it to the other one
    with pytest.raises(
        ValueError,
        match=r"reshard: bucket_bytes=200 is below what one dim-0 row of leaf 'big' takes on rank 0: 256 bytes "
        r"\(sent plus received, each peer's section padded to 8 bytes\); a bucket cuts a leaf along dim 0 no finer "
        r"than one row, so use a bucket of at least 256 bytes",
    ):
        plan_reshard(shapes, src, dst, Mesh.abstract({"tp": 2}), bucket_bytes=200)
    plan = plan_reshard(shapes, src, dst, Mesh.abstract({"tp": 2}), bucket_bytes=256)
    with pytest.raises(ValueError, match=r"the plan was made with bucket_bytes=256, but bucket_bytes=2048 was given"):
        reshard({"small": torch.zeros(2), "big": torch.zeros(4, 64)}, src, dst, MESH, plan=plan, bucket_bytes=2048)


def test_error_abstract_mesh_without_coordinate():
    with pytest.raises(ValueError, match=r"is abstract with no coordinate"):
        reshard({"w": torch.zeros(4)}, replicated(), sharded(0, "tp"), Mesh.abstract({"tp": 2}))


def test_errors_leave_the_source_untouched_and_exchange_nothing():
    tree = {"a": torch.arange(4.0), "b": torch.zeros(2, 3)}
    before = {k: v.clone() for k, v in tree.items()}
    with pytest.raises(LayoutError):  # 'a' is fine, 'b' does not fit: nothing is cut or sent for 'a' either
        reshard(tree, replicated(), {"a": sharded(0, "tp"), "b": sharded(1, "tp")}, MESH)
    assert all(torch.equal(tree[k], before[k]) for k in tree)


def test_no_exchange_when_every_rank_holds_what_it_needs():
    w = torch.arange(8.0).reshape(4, 2)
    out = reshard(
        {"w": w}, replicated(), sharded(0, "tp"), Mesh.abstract({"tp": 2}, 1)
    )  # abstract mesh: no collective possible
    assert torch.equal(out["w"], w[2:]) and out["w"].untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


def test_expert_parallel_to_tensor_parallel_experts():
    # 4 experts [E, 2F, D] over ep=2 -> every expert on both ranks, [gate|up] cut over tp (same 2 ranks)
    mesh = Mesh.abstract({"tp": 2})
    experts = torch.randn(4, 12, 3)
    src, dst = {"e": sharded(0, "tp")}, {"e": fused(1, [("gate", 6), ("up", 6)], "tp")}
    plan = plan_reshard({"e": ((4, 12, 3), torch.float32)}, src, dst, mesh)
    out = simulate([shard({"e": experts}, src, mesh, coordinate=r) for r in range(2)], plan)
    for r in range(2):
        assert torch.equal(out[r]["e"], shard({"e": experts}, dst, mesh, coordinate=r)["e"])
    assert [t.received for t in plan.traffic] == [2 * 6 * 3 * 4] * 2  # half of the other rank's experts
