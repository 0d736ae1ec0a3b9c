"""Layout rules checked against independent reference implementations (vLLM / nano-vllm / layer-sharding semantics)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from functional_npu import Block, Layout, LayoutError, Mesh, cyclic, fused, local_shape, replicated, shard, sharded
from functional_npu.core.layout import Cyclic, Shard


def test_layouts_are_printable_immutable_data():
    lay = fused(0, [Block("gate", 8), Block("up", 8)], "tp").with_dim(1, Shard(("dp",)))
    assert repr(lay) == "Layout(dim0=shard(tp [gate:8|up:8]), dim1=shard(dp))"
    assert repr(replicated()) == "replicated()"
    assert repr(cyclic(0, "dp", 5)) == "Layout(dim0=cyclic(dp, 5 layers))"
    assert lay == fused(0, [("gate", 8), ("up", 8)], "tp").with_dim(1, Shard(("dp",)))
    assert hash(lay) == hash(fused(0, [("gate", 8), ("up", 8)], "tp").with_dim(1, Shard(("dp",))))
    with pytest.raises(AttributeError):
        lay.dims = ()  # type: ignore[misc]
    assert lay.axes() == ("tp", "dp")
    assert sharded(1, ("dp", "tp")).dims == (None, Shard(("dp", "tp")))


def _vllm_qkv_shard(w, num_heads, num_kv, head_dim, tp, rank):
    """vLLM QKVParallelLinear: q heads split evenly; KV heads split, or replicated when tp > num_kv."""
    q, k, v = w.split([num_heads * head_dim, num_kv * head_dim, num_kv * head_dim])
    q_local = q.chunk(tp)[rank]
    if tp >= num_kv:
        replicas = tp // num_kv
        kv_id = rank // replicas
        k_local = k[kv_id * head_dim : (kv_id + 1) * head_dim]
        v_local = v[kv_id * head_dim : (kv_id + 1) * head_dim]
    else:
        k_local, v_local = k.chunk(tp)[rank], v.chunk(tp)[rank]
    return torch.cat([q_local, k_local, v_local])


@given(
    tp=st.sampled_from([1, 2, 4, 8]),
    num_kv=st.sampled_from([1, 2, 3, 4, 8]),
    heads_mult=st.integers(1, 2),
    head_dim=st.integers(1, 3),
)
def test_gqa_replication_matches_vllm_rule(tp, num_kv, heads_mult, head_dim):
    num_heads = math.lcm(tp, num_kv) * heads_mult  # q heads split evenly; whole GQA groups
    mesh = Mesh.abstract({"tp": tp})
    spec = fused(
        0,
        [
            Block("q", num_heads * head_dim, head_dim),
            Block("k", num_kv * head_dim, head_dim, True),
            Block("v", num_kv * head_dim, head_dim, True),
        ],
        "tp",
    )
    w = torch.randn((num_heads + 2 * num_kv) * head_dim, 5)
    if num_kv % tp and tp % num_kv:
        with pytest.raises(LayoutError, match="either"):
            shard(w, spec, mesh, coordinate=0)
        return
    for r in range(tp):
        assert torch.equal(shard(w, spec, mesh, coordinate=r), _vllm_qkv_shard(w, num_heads, num_kv, head_dim, tp, r))


@given(
    n=st.sampled_from([1, 2, 3, 4]), sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4), cols=st.integers(1, 3)
)
def test_fused_sharding_equals_sharding_each_block(n, sizes, cols):
    """nano-vllm MergedColumnParallelLinear: local = cat(block_i.chunk(tp)[rank])."""
    blocks = [Block(f"b{i}", s * n) for i, s in enumerate(sizes)]
    w = torch.randn(sum(b.size for b in blocks), cols)
    mesh = Mesh.abstract({"tp": n})
    for r in range(n):
        local = shard(w, fused(0, blocks, "tp"), mesh, coordinate=r)
        parts = w.split([b.size for b in blocks])
        assert torch.equal(local, torch.cat([p.chunk(n)[r] for p in parts]))
        assert torch.equal(local, torch.cat([shard(p, sharded(0, "tp"), mesh, coordinate=r) for p in parts]))


def _unpack_int4(x: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 holding 8 nibbles -> int4 values (as int32), along ``dim``; nibble k of word j is element 8j+k."""
    x = x.movedim(dim, -1)
    nib = torch.stack([(x >> (4 * k)) & 0xF for k in range(8)], dim=-1)
    return nib.flatten(-2).movedim(-1, dim)


def _pack_int4(v: torch.Tensor, dim: int) -> torch.Tensor:
    v = v.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    out = torch.zeros(v.shape[:-1], dtype=torch.int32)
    for k in range(8):
        out |= (v[..., k] & 0xF) << (4 * k)
    return out.movedim(-1, dim)


@given(
    n=st.sampled_from([1, 2, 4]),
    words_per_block=st.lists(st.integers(1, 2), min_size=1, max_size=3),
    dim=st.integers(0, 1),
    seed=st.integers(0, 2**16),
)
def test_packed_sharding_equals_unpack_shard_repack(n, words_per_block, dim, seed):
    """vLLM _adjust_shard_indexes_for_packing: offsets and sizes in packed units."""
    blocks = [Block(f"b{i}", 8 * w * n) for i, w in enumerate(words_per_block)]  # logical sizes
    packed_len = sum(b.size for b in blocks) // 8
    shape = (packed_len, 3) if dim == 0 else (3, packed_len)
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)
    mesh = Mesh.abstract({"tp": n})
    for r in range(n):
        packed_local = shard(w, fused(dim, blocks, "tp", pack=8), mesh, coordinate=r)
        logical_local = shard(_unpack_int4(w, dim), fused(dim, blocks, "tp"), mesh, coordinate=r)
        assert torch.equal(packed_local, _pack_int4(logical_local, dim))
        assert local_shape(shape, fused(dim, blocks, "tp", pack=8), mesh, coordinate=r, dtype=torch.int32) == tuple(
            packed_local.shape
        )


@given(layers=st.integers(1, 13), n=st.integers(1, 5))
def test_cyclic_ownership_is_layer_mod_n(layers, n):
    """Seed 000: layer l lives on coordinate l % n, at local position l // n; others hold nothing for it."""
    w = torch.arange(layers * 2, dtype=torch.float32).reshape(layers, 2)
    mesh = Mesh.abstract({"dp": n})
    locals_ = [shard(w, cyclic(0, "dp", layers), mesh, coordinate=c) for c in range(n)]
    for layer in range(layers):
        owner = layer % n
        assert torch.equal(locals_[owner][layer // n], w[layer])
    assert sum(x.shape[0] for x in locals_) == layers
    assert [x.shape[0] for x in locals_] == [len(range(c, layers, n)) for c in range(n)]


def test_cyclic_composes_with_tensor_parallel_dims():
    w = torch.randn(5, 4, 6)
    lay = Layout((Cyclic("dp", 5), None, Shard(("tp",))))
    mesh = Mesh.abstract({"dp": 2, "tp": 3})
    local = shard(w, lay, mesh, coordinate={"dp": 1, "tp": 2})
    assert torch.equal(local, w[1::2, :, 4:6])


def test_axes_and_blocks_normalize_to_hashable_tuples():
    assert Shard("tp") == Shard(("tp",)) and Shard(["dp", "tp"]).axes == ("dp", "tp")
    assert Shard("tp", [Block("a", 2)]).blocks == (Block("a", 2),)
    assert Layout([None, Shard("tp")]) == sharded(1, "tp")
    hash(Layout([None, Shard("tp", [Block("a", 2)])]))
