"""gather(shard(x)) == x on real gloo ranks (2 and 4), eager and under torch.compile(fullgraph=True) with inductor."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu import Block, Layout, fused, replicated, sharded
from functional_npu.core.layout import Cyclic, Shard

from ..support.strategies import leaf_case, mesh_axes
from ..support.workers import gather_roundtrip


@st.composite
def world_case(draw, world: int):
    axes = draw(mesh_axes(world=world))
    leaves = draw(st.lists(leaf_case(axes), min_size=1, max_size=3))
    return axes, leaves, draw(st.integers(0, 2**20))


def _check(results):
    for rank, (equal, aliased, _) in enumerate(results):
        assert all(equal.values()), (rank, equal)
        assert not aliased, rank


@settings(max_examples=40)
@given(world_case(2))
def test_gather_of_shard_is_identity_2_ranks(world2, case):
    _check(world2.run(gather_roundtrip, *case))


@settings(max_examples=25)
@given(world_case(4))
def test_gather_of_shard_is_identity_4_ranks(world4, case):
    _check(world4.run(gather_roundtrip, *case))


def model_like_leaves(tp_axes):
    """A transformer-shaped tree: GQA-fused qkv (KV heads replicated), [gate|up], row-parallel o/down,
    cyclic stacked layers with a TP dim, an int4-packed weight, a bf16 replicated norm."""
    head_dim = 2
    qkv = fused(
        0,
        [
            Block("q", 4 * head_dim, head_dim),
            Block("k", 1 * head_dim, head_dim, True),
            Block("v", 1 * head_dim, head_dim, True),
        ],
        tp_axes,
    )
    return [
        ((6 * head_dim, 8), torch.float32, qkv),
        ((16, 8), torch.float32, fused(0, [("gate", 8), ("up", 8)], tp_axes)),
        ((8, 8), torch.float32, sharded(1, tp_axes)),
        (
            (5, 8, 4),
            torch.float32,
            Layout((Cyclic("dp", 5), None, Shard((tp_axes,) if isinstance(tp_axes, str) else tuple(tp_axes)))),
        ),
        ((4, 8), torch.int32, fused(1, [Block("g", 32, 8), Block("u", 32, 8)], tp_axes, pack=8)),
        ((8,), torch.bfloat16, replicated()),
    ]


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "world, axes, gathers",
    [
        ("world2", {"dp": 1, "tp": 2}, 1),  # every sharded leaf in one all_gather over tp (dp has size 1)
        ("world4", {"dp": 2, "tp": 2}, 2),  # the tp leaves in one, the cyclic leaf (dp and tp) over the whole mesh
    ],
)
def test_gather_model_tree(request, world, axes, gathers, use_compile):
    results = request.getfixturevalue(world).run(gather_roundtrip, axes, model_like_leaves("tp"), 7, use_compile)
    _check(results)
    if use_compile:
        ops = results[0][2]
        assert ops.count("_c10d_functional.all_gather_into_tensor") == gathers
        assert ops.count("_c10d_functional.wait_tensor") == gathers


@settings(max_examples=3)
@given(world_case(2))
def test_gather_of_shard_compiled_random_layouts(world2, case):
    _check(world2.run(gather_roundtrip, *case, use_compile=True))
