"""reshard_params between a training and an inference plan on the same 2 gloo ranks: every leaf equals what
load_checkpoint reads for the destination plan (same tree structure: a layer-sharded series stacked, the rest
per layer), the input is left as it was, and each rank receives exactly the bytes it needs and does not hold,
counted from element ids by ``shard`` alone (tests/support/replan_workers.need_bytes)."""

import pytest
import torch

from functional_npu import Mesh, Plan, load_checkpoint
from functional_npu.runtime.training.weight_sync import reshard_params

from ..support.hf_models import save_tiny
from ..support.replan_workers import replan

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


def test_reshard_params_refuses_params_of_another_mesh_and_a_non_plan(model_dir):
    mesh = Mesh.abstract({"dp": 2, "tp": 1}, 0)
    params = load_checkpoint(model_dir, Mesh.abstract({"dp": 1, "tp": 2}, 0))
    with pytest.raises(ValueError, match=r"reshard_params: the params were placed for mesh \{'dp': 1, 'tp': 2\}"):
        reshard_params(params, Plan(tp="dp"), mesh)
    with pytest.raises(TypeError, match=r"reshard_params: plan must be a functional_npu.Plan, got dict"):
        reshard_params(params, {"tp": "dp"}, mesh)
    assert isinstance(params["embed"], torch.Tensor)
