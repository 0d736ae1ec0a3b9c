"""Params as one typed value: the tensor tree with the config and the placement as static fields. Tree maps keep
both; a leaf's path is the tree's; nothing static is a key; the value is immutable; dynamo traces it whole and
torch.func differentiates it into Params of the same config."""

import dataclasses
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from functional_npu import Mesh, Params, place, shard
from functional_npu.core import drop, flatten_with_paths, map_with_path
from functional_npu.models import llama

CFG = llama.LlamaConfig(
    architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
)  # fmt: skip


@st.composite
def trees(draw):
    n = draw(st.integers(0, 3))
    shapes = st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple)
    layers = [{f"w{j}": torch.zeros(draw(shapes)) for j in range(draw(st.integers(1, 2)))} for _ in range(n)]
    return {"embed": torch.zeros(draw(shapes)), "layers": layers}


@given(trees())
def test_a_tree_map_keeps_the_config_and_the_paths_are_the_trees(tree):
    p = Params(tree, CFG)
    assert [k for k, _ in flatten_with_paths(p)] == [k for k, _ in flatten_with_paths(tree)]
    doubled = map_with_path(lambda _, x: x + 1, p)
    assert isinstance(doubled, Params) and doubled.config is CFG and doubled.placement is None
    assert all(torch.equal(a + 1, b) for (_, a), (_, b) in zip(flatten_with_paths(p), flatten_with_paths(doubled)))
    assert drop(p, "layers").config is CFG and "layers" not in drop(p, "layers") and "layers" in p
    assert drop(dict(tree), "embed") == {"layers": tree["layers"]}


def test_shard_given_a_placement_carries_it_and_the_config_is_the_placements():
    mesh = Mesh.abstract({"tp": 2})
    placed = place(CFG, mesh)
    full = llama.init_params(CFG)
    local = shard(full, placed.layouts, mesh, coordinate={"tp": 1}, placement=placed)
    assert local.placement is placed and local.config is placed.config
    whole = full.placed(place(CFG, {"tp": 1}))  # a full tree's placement does not describe its shards
    assert shard(whole, placed.layouts, mesh, coordinate=0).placement is None
    with pytest.raises(TypeError, match=r"^shard: placement= is carried by Params; got a dict tree"):
        shard(dict(full.items()), placed.layouts, mesh, coordinate=0, placement=placed)


def test_nothing_static_is_a_key_and_the_value_is_immutable():
    p = llama.init_params(CFG)
    with pytest.raises(KeyError, match=r"params\['config'\]: the config is a field of the params, not a key"):
        p["config"]
    with pytest.raises(TypeError, match=r"^Params: \['placement'\] in the tree; the config and the placement are"):
        Params({"embed": torch.zeros(1), "placement": None}, CFG)
    with pytest.raises(AttributeError, match=r"^Params is immutable"):
        p.config = None
    with pytest.raises(TypeError, match=r"^Params\(tree=...\): a dict of tensors, got list"):
        Params([torch.zeros(1)], CFG)
    other = dataclasses.replace(CFG, rope_theta=2e4)
    with pytest.raises(ValueError, match=r"^Params: the placement was made for 'LlamaForCausalLM', not for the config"):
        Params(p.tree, other, place(CFG, {"tp": 1}))
    back = pickle.loads(pickle.dumps(p))  # a saved graph's inputs are pickled: as made, never field by field
    assert back.config == CFG and torch.equal(back["embed"], p["embed"]) and back.placement is None
    assert (p | {"norm": torch.ones(32)}).config is CFG and torch.equal(
        (p | {"norm": torch.ones(32)})["norm"], torch.ones(32)
    )


def test_dynamo_traces_params_whole_and_grad_returns_params():
    p = Params({"embed": torch.randn(8, 4), "layers": [{"w": torch.randn(4, 4)} for _ in range(2)]}, CFG)

    def f(params, x):
        h = params["embed"][x]
        for layer in params["layers"]:
            h = h @ layer["w"]
        return h.sum() + (params["lm_head"].sum() if "lm_head" in params else 0)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.tensor([1, 2])
    other = map_with_path(lambda _, t: t * 2, p)
    assert torch.allclose(compiled(p, x), f(p, x)) and torch.allclose(compiled(other, x), f(other, x))
    g = torch.func.grad(f)(p, x)
    assert isinstance(g, Params) and g.config is CFG and g["layers"][1]["w"].shape == (4, 4)
