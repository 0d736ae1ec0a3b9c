"""The step model prices the collectives the runtime runs: each technique's forward step on 4 gloo ranks, every
collective counted as it is dispatched (:class:`benchmarks.counting.ReceivedBytes`: the bytes each rank receives
from the others, and the calls), against :func:`~functional_npu.runtime.planning.step_collectives` for the same plan
and workload. Nothing on the counted side comes from the step model.

Expert parallelism over a tensor-parallel axis is the case that fails without the runtime's rule: each tp rank
routes its own 1 / tp of the tokens and gathers the outputs back; a model that has every tp rank dispatch every
token (each token once per expert it chose) prices ``tp`` times the bytes (:func:`test_the_old_ep_rule_overcounts`)."""

import dataclasses

import pytest
import torch

from functional_npu import Plan, layer_shard, split_dp
from functional_npu.parallel.devices import collective_factor
from functional_npu.runtime.planning import Candidate, Workload, step_collectives, step_transfers
from tools.aten_graphs import GRAPH_CONFIGS

from ..support.count_workers import counted_ring_step, counted_step

OPS = {
    "_c10d_functional.all_reduce": "all_reduce",
    "_c10d_functional.all_gather_into_tensor": "all_gather",
    "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional.all_to_all_single": "all_to_all",
}
MODULES = {"o_proj": 2, "mlp": 2, "lm_head": 2, "embed": 2}
# (name, family, mesh axes, plan fields, batch, new tokens per sequence, cached positions)
CASES = [
    ("dense tp 2", "qwen3", {"dp": 2, "tp": 2}, {}, 4, 1, 8),
    ("EP over dp x tp, decode: gathered", "qwen3_moe", {"dp": 2, "tp": 2}, {"expert_axes": ("dp", "tp")}, 4, 1, 8),
    ("EP over dp x tp, prefill: dispatched", "qwen3_moe", {"dp": 2, "tp": 2}, {"expert_axes": ("dp", "tp")}, 4, 16, 0),
    ("EP over dp, experts' down over tp", "qwen3_moe", {"dp": 2, "tp": 2}, {"expert_axes": ("dp",)}, 4, 16, 0),
    (
        "EP over dp x tp, shared experts (MLA)",
        "deepseek_v3",
        {"dp": 2, "tp": 2},
        {"expert_axes": ("dp", "tp")},
        4,
        1,
        8,
    ),  # noqa: E501
    ("EP over tp 4, prefill", "qwen3_moe", {"dp": 1, "tp": 4}, {"expert_axes": ("tp",)}, 2, 32, 0),
    ("module TP over dp 4 (all four)", "qwen3", {"dp": 4, "tp": 1}, {"module_tp": MODULES}, 8, 1, 8),
    ("module TP, prefill", "qwen3", {"dp": 4, "tp": 1}, {"module_tp": MODULES}, 8, 16, 0),
]


def _modelled(family, axes, fields, batch, length, context):
    fields = dict(fields)
    if "module_tp" in fields:
        axes, fields["module_tp"] = split_dp(axes, fields["module_tp"])
    cfg = GRAPH_CONFIGS[family]
    work = Workload.decode(batch, context) if length == 1 else Workload.prefill(length, batch)
    return step_collectives(cfg, Candidate("case", dict(axes), Plan(**fields)), work, dtype=torch.float32)


@pytest.fixture(scope="module")
def counted(world4):
    """Every case's counted step, one world for all."""
    out = {}
    for name, family, axes, fields, batch, length, context in CASES:
        out[name] = world4.run(counted_step, GRAPH_CONFIGS[family], axes, dict(fields), batch, length, context)
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_modelled_collectives_are_the_counted_ones(counted, case):
    name, family, axes, fields, batch, length, context = case
    modelled = _modelled(family, axes, fields, batch, length, context)
    calls: dict[str, int] = {}
    for c in modelled:
        calls[c.kind] = calls.get(c.kind, 0) + c.count
    received = sum(c.received for c in modelled)
    for rank, got in enumerate(counted[name]):
        assert {OPS[op]: n for op, n in got["calls"].items()} == calls, f"rank {rank}"
        assert got["received"] == pytest.approx(received, rel=1e-12), f"rank {rank}"


def test_the_old_ep_rule_overcounts(counted):
    """The rule the step model had: every rank dispatches its whole token set, each token once per chosen expert,
    to the expert group in both directions. Counted at tp 4 (top 2 of 8 experts), the runtime moves about half of
    that: each of the 4 tp ranks sends its quarter of the tokens to all 4 expert ranks, not all of them twice."""
    name = "EP over tp 4, prefill"
    _, family, axes, fields, batch, length, context = next(c for c in CASES if c[0] == name)
    cfg = GRAPH_CONFIGS[family]
    tokens, n, layers = batch // axes["dp"] * length, axes["tp"], len(cfg.moe_layers)
    old = 2 * layers * collective_factor("all_to_all", n) * tokens * cfg.top_k * cfg.hidden_size * 4
    got = counted[name][0]["by_op"]["_c10d_functional.all_to_all_single"]
    new = sum(c.received for c in _modelled(family, axes, fields, batch, length, context) if c.kind == "all_to_all")
    assert got == pytest.approx(new) and old > 1.5 * got


RINGS = [  # (name, dp, layer-sharded series, host series, k)
    ("layer shard o_proj,down_proj over dp 4, k 1", 4, "o_proj,down_proj", "", 1),
    ("layer shard, whole layers, k 0", 4, "layer", "", 0),
    ("host series down_proj, k 1", 4, None, "down_proj", 1),
    ("both sources, k 1", 4, "o_proj", "down_proj", 1),
]
RING_STEPS = 3


@pytest.fixture(scope="module")
def counted_rings(world4):
    cfg = dataclasses.replace(GRAPH_CONFIGS["qwen3"], num_layers=4)
    return {n: world4.run(counted_ring_step, cfg, dp, s, o, k, 1, RING_STEPS) for n, dp, s, o, k in RINGS}


@pytest.mark.parametrize("case", RINGS, ids=lambda c: c[0])
def test_modelled_ring_transfers_are_the_counted_ones(counted_rings, case):
    """Per decode step, past the ring's start: one broadcast per layer of the layer-sharded series (every rank in it,
    each rank receiving the layers it does not own) and one host copy per layer, each of one layer's bytes."""
    name, dp, series, offload, k = case
    cfg = dataclasses.replace(GRAPH_CONFIGS["qwen3"], num_layers=4)
    plan = Plan(layer_shard=layer_shard(series, "dp") if series else None, offload=offload, prefetch_step=k)
    modelled = {
        c.kind: c
        for c in step_transfers(cfg, Candidate(name, {"dp": dp, "tp": 1}, plan), Workload.decode(1, 8), torch.float32)
    }
    assert set(modelled) == {kind for kind, on in (("broadcast", series), ("host_copy", offload)) if on}
    received = []
    for got in counted_rings[name]:
        start, total = got["started"], got["total"]
        per_step = {key: (total[key] - start[key]) / RING_STEPS for key in total}
        if series:
            assert per_step["broadcast_calls"] == modelled["broadcast"].count
            received.append(per_step["broadcast_received"])
        if offload:
            assert per_step["copy_calls"] == modelled["host_copy"].count
            assert per_step["copy_bytes"] == modelled["host_copy"].received
    if series:  # each rank receives the layers it does not own; over the group, the modelled average
        assert sum(received) / len(received) == pytest.approx(modelled["broadcast"].received)
        assert max(received) <= modelled["broadcast"].count * modelled["broadcast"].payload
