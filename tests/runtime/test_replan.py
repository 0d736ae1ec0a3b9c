"""reshard_params between a training and an inference plan on the same 2 gloo ranks: every leaf equals what
load_checkpoint reads for the destination plan (same tree structure: a layer-sharded series stacked, the rest
per layer), the input is left as it was, and each rank receives exactly the bytes it needs and does not hold,
counted from element ids by ``shard`` alone (tests/support/replan_workers.need_bytes)."""

import dataclasses

import pytest
import torch

from functional_npu import Mesh, Params, Plan, load_checkpoint
from functional_npu.placement import place
from functional_npu.runtime.training.weight_sync import plan_params_reshard, reshard_params

from ..support.hf_models import save_tiny
from ..support.replan_workers import bucketed_sync, disagreeing_buckets, replan

LAYER_SHARDED = {"layer_shard": "layer", "prefetch_step": 1}
PAIRS = [
    (LAYER_SHARDED, {"tp": "dp"}),  # ZeRO-3-like training -> tp over the same ranks
    ({"tp": "dp"}, LAYER_SHARDED),
    ({"layer_shard": "o_proj,down_proj"}, {"tp": "dp"}),  # some series layer-sharded, the rest replicated
    ({}, {"tp": "dp"}),  # replicated -> tp: nothing to move
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-4l")
    save_tiny("qwen3", path, 11, num_hidden_layers=4)
    return str(path)


@pytest.mark.parametrize("src,dst", PAIRS, ids=["zero3-to-tp", "tp-to-zero3", "series-to-tp", "dp-to-tp"])
def test_reshard_params_equals_the_loader_and_moves_the_lower_bound(world2, model_dir, src, dst):
    for rank, r in enumerate(world2.run(replan, model_dir, {"dp": 2, "tp": 1}, src, dst)):
        assert r["same"] and r["untouched"], rank
        assert r["received"] == r["lower_bound"] == r["need"], (rank, r)
    if dst == {"tp": "dp"} and src:
        assert r["need"] > 0


@pytest.mark.parametrize("src,dst", PAIRS[:2], ids=["zero3-to-tp", "tp-to-zero3"])
def test_bucketed_sync_holds_one_bucket_and_a_leaf_and_equals_the_whole_exchange(world2, model_dir, src, dst):
    """Measured, not taken from the plan: with a bucket of a quarter of the largest stacked leaf (so the stacked
    leaves move in slabs of layers), the peak bytes a rank holds beside the result while the sync runs
    (benchmarks.memory.LiveBytes) stay within one bucket plus the largest leaf (the stacked destination leaf being
    filled, or one slab's layers stacked from the source), where the one exchange of everything passes that bound (so
    the measure can fail); the bytes counted at the all_to_all_single calls (one per bucket that moves anything) are
    the lower bound plus at most the 8-byte padding per peer per bucket; the params are bitwise the unbucketed sync's
    and the loader's under the destination plan."""
    for rank, r in enumerate(world2.run(bucketed_sync, model_dir, {"dp": 2, "tp": 1}, src, dst, 0.25)):
        bound = r["bucket"] + r["largest"]
        assert r["bucket"] < r["largest_stacked"] / 2 and any(p.startswith("stack.") for p in r["cut"]), (rank, r)
        assert r["same_as_whole"] and r["same_as_loader"], rank
        assert r["runs"]["buckets"]["peak"] <= bound < r["runs"]["whole"]["peak"], (rank, bound, r["runs"])
        assert r["received"] == r["lower_bound"] > 0, (rank, r)
        assert r["runs"]["buckets"]["calls"] == r["moving_buckets"] >= 3 and r["runs"]["whole"]["calls"] == 1
        for name, buckets in (("whole", 1), ("buckets", r["moving_buckets"])):
            counted = r["runs"][name]["received"]
            assert r["lower_bound"] <= counted <= r["lower_bound"] + 7 * r["peers"] * buckets, (rank, name, counted)


def test_reshard_params_refuses_params_of_another_mesh_and_a_non_plan(model_dir):
    mesh = Mesh.abstract({"dp": 2, "tp": 1}, 0)
    params = load_checkpoint(model_dir, Mesh.abstract({"dp": 1, "tp": 2}, 0))
    with pytest.raises(ValueError, match=r"reshard_params: the params were placed for mesh \{'dp': 1, 'tp': 2\}"):
        reshard_params(params, Plan(tp="dp"), mesh)
    with pytest.raises(TypeError, match=r"reshard_params: plan must be a functional_npu.Plan or a Placement, got dict"):
        reshard_params(params, {"tp": "dp"}, mesh)
    assert isinstance(params["embed"], torch.Tensor)


def test_reshard_params_refuses_bad_buckets_and_a_target_of_another_model(model_dir):
    mesh = Mesh.abstract({"dp": 2, "tp": 1}, 0)
    params = load_checkpoint(model_dir, mesh, Plan(**LAYER_SHARDED))
    with pytest.raises(ValueError, match=r"reshard_params: bucket_bytes must be positive .*, got 0; pass None"):
        reshard_params(params, Plan(tp="dp"), mesh, bucket_bytes=0)
    with pytest.raises(
        ValueError,
        match=r"reshard_params: bucket_bytes=1000 is below what one layer of leaf 'layers\.\*\.qkv' takes on rank 0: "
        r"32768 bytes \(sent plus received, .*\); a bucket cuts a leaf every layer has no finer than one layer \(a row "
        r"of it stacked\), so use a bucket of at least 32768 bytes",
    ):
        reshard_params(params, Plan(tp="dp"), mesh, bucket_bytes=1000)
    cfg = params.config
    other = place(dataclasses.replace(cfg, num_layers=2, rope_theta=cfg.rope_theta * 2), mesh, Plan(tp="dp"))
    with pytest.raises(
        ValueError,
        match=r"reshard_params: the target placement is for another model than the params: num_layers=2 \(the "
        r"params: 4\); rope_theta=20000.0 \(the params: 10000.0\); place the inference plan on the params' config",
    ):
        reshard_params(params, other, mesh)
    with pytest.raises(
        ValueError, match=r"reshard_params: the plan was made for LlamaForCausalLM, but this model is a"
    ):
        reshard_params(params, Plan(tp="dp", model="LlamaForCausalLM"), mesh)
    own = place(cfg, mesh, Plan(tp="dp"))  # a placement of the params' own config is the plan itself
    assert plan_params_reshard(params, own, mesh).traffic == plan_params_reshard(params, Plan(tp="dp"), mesh).traffic


def test_ranks_that_disagree_on_the_buckets_stop_before_the_exchange(world2, model_dir):
    """Once: ranks with different bucket_bytes aborted the world, or waited out a 60 s gloo timeout."""
    got = world2.run(disagreeing_buckets, model_dir, {"dp": 2, "tp": 1}, LAYER_SHARDED, {"tp": "dp"})
    assert got[0] == got[1] and "the buckets" in got[0] and "bucket_bytes" in got[0]
    assert got[0].endswith("every rank stopped before the exchange")


def test_extra_or_meta_leaves_and_a_wrong_exchange_are_one_line(model_dir):
    mesh = Mesh.abstract({"dp": 2, "tp": 1}, 0)
    params = load_checkpoint(model_dir, mesh)
    extra = Params(dict(params.tree) | {"extra": torch.zeros(3)}, placement=params.placement)
    with pytest.raises(ValueError, match=r"^reshard_params: params\['extra'\] is not a leaf of the Qwen3ForCausalLM "):
        reshard_params(extra, Plan(tp="dp"), mesh)
    meta = Params(dict(params.tree) | {"embed": params["embed"].to("meta")}, placement=params.placement)
    with pytest.raises(ValueError, match=r"^reshard_params: params\['embed'\] is on the meta device"):
        reshard_params(meta, Plan(tp="dp"), mesh)
    with pytest.raises(TypeError, match=r"^reshard_params: exchange must be the ReshardPlan .* got dict"):
        reshard_params(params, Plan(tp="dp"), mesh, exchange={})
