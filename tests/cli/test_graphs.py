"""Golden captured graphs: regenerate every artifact and compare with graphs/
(drift must be regenerated and reviewed)."""

import json

import pytest

from functional_npu.cli.graphs import GRAPH_CONFIGS, PHASES, TP_SIZES, regenerate
from functional_npu.models import llama, moe

from ..support import GRAPHS


@pytest.fixture(scope="module")
def drift(world2):
    return regenerate(GRAPHS, check=True, world=world2)


def test_graphs_match_the_committed_artifacts(drift):
    assert drift == [], f"graphs/ drifted from the code; run `python -m functional_npu graphs` and review: {drift}"


DENSE = [f for f, c in GRAPH_CONFIGS.items() if isinstance(c, llama.LlamaConfig)]
MOE = [f for f, c in GRAPH_CONFIGS.items() if isinstance(c, moe.MoeConfig)]


@pytest.mark.parametrize("family", DENSE)
def test_collective_schedule_is_the_tp_plan(drift, family):
    cfg = GRAPH_CONFIGS[family]
    for phase in PHASES:
        for tp in TP_SIZES:
            name = f"{family}-tp{tp}-{phase}"
            schedule = json.loads((GRAPHS / name / "collectives.json").read_text())
            if tp == 1:
                assert schedule == [], name  # size-1 axes emit nothing
                continue
            ops = [c["op"].split(".")[1] for c in schedule]
            # vocab-parallel embedding, o_proj + down per layer, lm_head gather: in program order
            assert ops == ["all_reduce"] + ["all_reduce"] * (2 * cfg.num_layers) + ["all_gather_into_tensor"], name
            assert {c["axis"] for c in schedule} == {"tp"}


@pytest.mark.parametrize("family", MOE)
def test_moe_schedule_is_the_expert_parallel_plan(drift, family):
    """Experts over tp: each layer's o_proj all_reduce, then the tokens split over tp and exchanged --
    prefill: all_to_all of tokens, routing and results; decode: all_gather + reduce_scatter -- then gathered back."""
    cfg = GRAPH_CONFIGS[family]
    moe_ops = {"prefill": ["all_to_all_single"] * 3, "decode": ["all_gather_into_tensor", "reduce_scatter_tensor"]}
    for phase in PHASES:
        schedule = json.loads((GRAPHS / f"{family}-tp2-{phase}" / "collectives.json").read_text())
        layer = ["all_reduce"] + moe_ops[phase] + ["all_gather_into_tensor"]
        assert [c["op"].split(".")[1] for c in schedule] == ["all_reduce"] + layer * cfg.num_layers + [
            "all_gather_into_tensor"
        ], phase
        assert json.loads((GRAPHS / f"{family}-tp1-{phase}" / "collectives.json").read_text()) == []


def test_layer_sharded_schedule_prefetches_one_layer_ahead(drift):
    """o_proj and down over dp = 2 with k = 1: layer l + 1's two broadcasts issued before layer l, layer 0's
    weights carried in; src alternates with the owner l % 2; the last two fetch the next step's layer 0."""
    from functional_npu.cli.graphs import LAYER_SHARD_SERIES

    cfg = GRAPH_CONFIGS["qwen3"]
    assert LAYER_SHARD_SERIES == "o_proj,down_proj"
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    for phase in PHASES:
        schedule = json.loads((GRAPHS / f"qwen3-dp2-layer_shard-k1-{phase}" / "collectives.json").read_text())
        fetched = [(li + 1) % cfg.num_layers for li in range(cfg.num_layers)]  # the layer issued during layer li
        assert [c["src"] for c in schedule] == [li % 2 for li in fetched for _ in range(2)]  # from its owner
        assert [c["op"] for c in schedule] == ["_c10d_functional.broadcast.default"] * (2 * cfg.num_layers)
        assert [c["bytes"] for c in schedule] == [4 * d * h, 4 * d * f] * cfg.num_layers
        assert {c["axis"] for c in schedule} == {"dp"}
        graph = (GRAPHS / f"qwen3-dp2-layer_shard-k1-{phase}" / "graph.txt").read_text()
        # one wait per broadcast, and one per carried weight (layer 0's two)
        assert graph.count("= torch.ops._c10d_functional.wait_tensor.default(") == 2 * cfg.num_layers + 2
