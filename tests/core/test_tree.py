import pytest
import torch

from functional_npu import check_structure, flatten_with_paths, map_with_path, tree_from_paths
from functional_npu.core.tree import expand_prefix


def test_flatten_with_dotted_paths_and_roundtrip():
    tree = {"layers": [{"attn": {"qkv": 1}}, {"attn": {"qkv": 2}}], "norm": 3}
    flat = flatten_with_paths(tree)
    assert flat == [("layers.0.attn.qkv", 1), ("layers.1.attn.qkv", 2), ("norm", 3)]
    assert tree_from_paths(flat) == {"layers": {"0": {"attn": {"qkv": 1}}, "1": {"attn": {"qkv": 2}}}, "norm": 3}


def test_map_with_path_is_pure():
    tree = {"a": torch.ones(2), "b": {"c": torch.zeros(1)}}
    out = map_with_path(lambda p, x: (p, x.sum().item()), tree)
    assert out == {"a": ("a", 2.0), "b": {"c": ("b.c", 0.0)}}
    assert torch.equal(tree["a"], torch.ones(2))


def test_tree_from_paths_rejects_leaf_and_prefix_clash():
    with pytest.raises(ValueError, match="'a' is already a leaf"):
        tree_from_paths({"a": 1, "a.b": 2})


def test_check_structure_names_every_missing_and_unexpected_path():
    want = {"embed": 0, "layers": {"0": {"q": 0, "k": 0}}}
    got = {"embed": 0, "layers": {"0": {"q": 0, "kk": 0}}, "extra": 1}
    with pytest.raises(ValueError) as e:
        check_structure(got, want)
    msg = str(e.value)
    assert "missing (1): layers.0.k" in msg
    assert "unexpected (2): extra, layers.0.kk" in msg


def test_expand_prefix_longest_prefix_wins():
    tree = {"layers": {"0": {"q": 1, "o": 2}, "1": {"q": 3, "o": 4}}, "norm": 5}
    prefix = {"layers": "L", "layers.1.o": "special", "norm": "N"}
    # a dotted key is just a key: expand by nested dicts instead
    prefix = {"layers": {"0": "L0", "1": {"q": "L1q", "o": "special"}}, "norm": "N"}
    got = expand_prefix(prefix, tree, is_leaf=lambda x: isinstance(x, str))
    assert got == {"layers.0.q": "L0", "layers.0.o": "L0", "layers.1.q": "L1q", "layers.1.o": "special", "norm": "N"}
    assert expand_prefix("ALL", tree, is_leaf=lambda x: isinstance(x, str))["norm"] == "ALL"


def test_expand_prefix_reports_uncovered_and_unused():
    tree = {"a": 1, "b": {"c": 2}}
    with pytest.raises(ValueError) as e:
        expand_prefix({"a": "x", "z": "y"}, tree, is_leaf=lambda x: isinstance(x, str))
    assert "params with no spec (1): b.c" in str(e.value)
    assert "specs for paths not in params (1): z" in str(e.value)


def test_registered_dataclass_pytrees_have_attribute_paths():
    from dataclasses import dataclass

    import torch.utils._pytree as pytree

    from functional_npu import Mesh, shard, sharded

    @dataclass
    class Attn:
        qkv: torch.Tensor
        o: torch.Tensor

    pytree.register_dataclass(Attn)
    try:
        tree = {"layers": [Attn(torch.arange(4.0), torch.arange(6.0))]}
        assert [p for p, _ in flatten_with_paths(tree)] == ["layers.0.qkv", "layers.0.o"]
        local = shard(tree, {"layers": sharded(0, "tp")}, Mesh.abstract({"tp": 2}), coordinate=1)
        assert isinstance(local["layers"][0], Attn)
        assert torch.equal(local["layers"][0].o, torch.tensor([3.0, 4.0, 5.0]))
    finally:
        pytree._deregister_pytree_node(Attn)
