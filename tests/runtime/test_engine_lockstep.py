"""The engine across ranks in lockstep, on two gloo ranks: rank 0 schedules and samples, rank 1 runs the same calls;
each request's tokens are those of generating it alone on the same ranks, under tensor parallelism, experts over the
ranks, every module tensor-parallel over the dp ranks (module TP), and a layer-sharded series fetched through the
prefetch ring (one ring carried through every bucket's steps)."""

import pytest

from ..support.engine_workers import served_by_replicas, served_in_lockstep
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


REPLICA_PROMPTS = [[5, 6, 7], list(range(1, 12)), [9, 9], list(range(30, 38)), [4], [11, 12, 13, 14]]
REPLICA_NEW = [6, 9, 4, 7, 5, 8]


@pytest.mark.parametrize(
    "moe, axes, plan, replicas",
    [
        (False, {"dp": 2, "tp": 1}, {"layer_shard": "o_proj,down_proj", "prefetch_step": 1}, "dp"),
        (True, {"dp": 2, "tp": 1}, {"expert_axes": ("dp",)}, "dp"),
        (
            False,
            {"dp": 1, "dp2": 2, "tp": 1},
            {"module_tp": {m: ("dp2",) for m in ("o_proj", "lm_head", "embed", "mlp")}},
            ("dp", "dp2"),
        ),
    ],
    ids=["layer-shard-dp2-k1", "moe-experts-over-dp2", "module-tp-dp2"],
)
def test_replicas_serve_requests_of_their_own_as_generate_alone(world2, model_dir, moe_dir, moe, axes, plan, replicas):
    """Engine(replicas=...) over 2 data-parallel ranks: the requests are spread over both replicas, each gets the
    tokens of generating it alone on one rank (a model loaded without the plan), in fewer steps than one batch on
    both ranks takes (batch buckets of at most 2: two replicas hold twice the rows), and every replica's pool ends
    empty. Under module TP each module's exchanges take both ranks' own rows."""
    first, other = world2.run(
        served_by_replicas, moe_dir if moe else model_dir, axes, plan, REPLICA_PROMPTS, REPLICA_NEW, replicas
    )
    assert other is None
    replicas, one = first["replicas"], first["one_batch"]
    assert replicas["served"] == one["served"] == first["alone"]
    assert sorted(set(replicas["replica"])) == [0, 1] and set(one["replica"]) == {0}
    assert replicas["steps"] < one["steps"], (replicas["steps"], one["steps"])
    assert replicas["free"] and one["free"]


def test_replicas_over_the_tensor_parallel_axis_or_no_axis_are_refused(model_dir):
    """Tensor parallelism computes one batch across its axis: replicas over it are refused by name, and so are an
    axis the mesh lacks, a repeated one, a name that is not a str, and replicas without lockstep."""
    from functional_npu import Mesh, Plan, compile_model, load_checkpoint
    from functional_npu.runtime.serving import Engine
    from functional_npu.runtime.serving.replicas import check_replicas

    mesh = Mesh.abstract({"dp": 2, "dp2": 2, "tp": 2}, 0)
    assert check_replicas(Plan(expert_axes=("dp",)), mesh, "dp") == (("dp",), 2)
    assert check_replicas(Plan(module_tp={"o_proj": ("dp2",)}), mesh, ("dp", "dp2")) == (("dp", "dp2"), 4)
    with pytest.raises(ValueError, match=r"^Engine: replicas=\('dp', 'tp'\) include the plan's tensor-parallel axis"):
        check_replicas(Plan(), mesh, ("dp", "tp"))
    with pytest.raises(ValueError, match=r"replicas='ep' are not distinct axes of the mesh .* \(\['ep'\]\)"):
        check_replicas(Plan(), mesh, "ep")
    with pytest.raises(ValueError, match=r"replicas=\('dp', 'dp'\) are not distinct axes .* \(repeated\)"):
        check_replicas(Plan(), mesh, ("dp", "dp"))
    with pytest.raises(TypeError, match=r"replicas must be a mesh axis name or a tuple of them, got int 2"):
        check_replicas(Plan(), mesh, 2)
    one = Mesh.abstract({"dp": 1, "tp": 1}, 0)
    model = compile_model(load_checkpoint(model_dir, one), one, backend="none", max_seq_len=48, prefill_lengths=[8])
    with pytest.raises(ValueError, match=r"replicas='dp' serve in lockstep across ranks: pass lockstep=True"):
        Engine(model, blocks=20, block_size=4, replicas="dp")
