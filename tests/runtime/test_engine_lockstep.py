"""The engine across ranks in lockstep, on two gloo ranks: rank 0 schedules and samples, rank 1 runs the same calls;
each request's tokens are those of generating it alone on the same ranks, under tensor parallelism, experts over the
ranks, every module tensor-parallel over the dp ranks (module TP), and a layer-sharded series fetched through the
prefetch ring (one ring carried through every bucket's steps)."""

import pytest

from ..support.engine_workers import served_in_lockstep
from ..support.hf_models import save_tiny, save_tiny_moe

PROMPTS = [[5, 6, 7], list(range(1, 20)), [9, 9], list(range(30, 41))]
NEW = [6, 9, 4, 12]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-lockstep")
    save_tiny("qwen3", path, 5, num_hidden_layers=3)
    return str(path)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-lockstep-moe")
    save_tiny_moe("qwen3_moe", path, 5)
    return str(path)


@pytest.mark.parametrize(
    "moe, axes, plan",
    [
        (False, {"tp": 2}, {"tp": "tp"}),
        (False, {"dp": 2, "tp": 1}, {"layer_shard": "o_proj,down_proj", "prefetch_step": 1}),
        (True, {"tp": 2}, {"tp": "tp", "expert_axes": ("tp",)}),
        (
            False,
            {"dp": 1, "dp2": 2, "tp": 1},
            {"module_tp": {m: ("dp2",) for m in ("o_proj", "lm_head", "embed", "mlp")}},
        ),
    ],
    ids=["tp2", "layer-shard-dp2-k1", "moe-experts-over-tp2", "module-tp-dp2"],
)
def test_a_lockstep_engine_serves_each_request_as_generate_alone(world2, model_dir, moe_dir, moe, axes, plan):
    first, other = world2.run(served_in_lockstep, moe_dir if moe else model_dir, axes, plan, PROMPTS, NEW)
    assert other is None
    assert first["served"] == first["alone"] and first["free"]


def test_an_engine_out_of_lockstep_refuses_to_follow(model_dir):
    from functional_npu import Mesh, compile_model, load_checkpoint
    from functional_npu.runtime.serving import Engine

    one = Mesh.abstract({"tp": 1}, 0)
    model = compile_model(load_checkpoint(model_dir, one), one, backend="none", max_seq_len=48, prefill_lengths=[8])
    with pytest.raises(ValueError, match=r"only the other ranks of a lockstep engine follow"):
        Engine(model, blocks=20, block_size=4).follow()
    with pytest.raises(ValueError, match=r"process group is not initialized"):
        Engine(model, blocks=20, block_size=4, lockstep=True)
