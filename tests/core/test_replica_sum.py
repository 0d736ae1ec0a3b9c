"""Gradient sharding for random layouts on real gloo ranks: the gradient shares of a loss every rank computes
alike, summed over each element's holders by :func:`sum_replicas` (the plan read from the layout alone), equal
the unsharded gradient sharded by :func:`shard`, for replicated leaves, sharded dims in any axis order, fused
blocks with replicated units (GQA KV heads) and cyclic dims. The same shares unsummed must differ wherever some
element has several holders (the check can fail)."""

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from functional_npu.core.layout import Shard

from ..support.grad_workers import replica_grads
from ..support.strategies import leaf_case, mesh_axes


@st.composite
def world_case(draw, world: int):
    axes = draw(mesh_axes(world=world))
    leaves = draw(st.lists(leaf_case(axes), min_size=1, max_size=3))
    assume(all(not (isinstance(d, Shard) and d.pack > 1) for _, _, lay in leaves for d in lay.dims))
    return axes, leaves, draw(st.integers(0, 2**20))


def _check(results, case):
    axes, leaves, _ = case
    for rank, out in enumerate(results):
        for path, (summed, _) in out.items():
            assert summed, f"rank {rank}: {path} ({leaves[int(path[1:])]}) on {axes}: summed shares differ"
    shared = [any(not unsummed for _, unsummed in out.values()) for out in results]
    replicated = any(n > 1 for a, n in axes.items() for _, _, lay in leaves if a not in lay.axes())
    if replicated:
        assert any(shared), "a leaf replicated over an axis of size > 1 must need its shares summed"


@settings(max_examples=30)
@given(world_case(2))
def test_summed_shares_are_the_sharded_gradient_2_ranks(world2, case):
    _check(world2.run(replica_grads, *case), case)


@settings(max_examples=20)
@given(world_case(4))
def test_summed_shares_are_the_sharded_gradient_4_ranks(world4, case):
    _check(world4.run(replica_grads, *case), case)
