"""Layer-sharded weight series: layouts, loading only owned layers, prefetch schedule, parity, memory."""

import dataclasses
import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from functional_npu import LayerShard, Mesh, Plan, compile_model, flatten_with_paths, load_checkpoint, shard, unshard
from functional_npu.checks import check, from_inductor_code
from functional_npu.models import init_state, llama, series_leaves
from functional_npu.parallel.layer_shard import (
    layer_shard,
    owned_layers,
    resident_bytes,
    series_bound,
    series_specs,
    stack_series,
    unstack_series,
)
from functional_npu.placement import check_plan

from ..support.configs import DENSE, MLA, MOE
from ..support.delivery import assert_every_write_delivered
from ..support.hf_models import hf_greedy, save_tiny, save_tiny_moe
from ..support.prefetch_workers import (
    generate_layer_sharded,
    ring_addresses,
    ring_hazards,
    ring_logits,
    ring_saved_graphs,
)

LAYERS = 6
PROMPTS = [[5, 9, 2], [7] * 11, [1, 2, 3, 4, 5, 6]]
NEW = 8


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A 6-layer tiny Qwen3 saved by transformers, and its greedy tokens for PROMPTS."""
    path = tmp_path_factory.mktemp("qwen3_ls")
    model = save_tiny("qwen3", path, 11, num_hidden_layers=LAYERS)
    return str(path), [hf_greedy(model, p, NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def qwen3_3l(tmp_path_factory):
    """A 3-layer tiny Qwen3 and its greedy tokens: a ring of 2 slots (k = 1) goes through 2 phases over its steps, in
    half the graph the 6-layer model traces (for the tests that compile a ring of several phases)."""
    path = tmp_path_factory.mktemp("qwen3_ls3")
    model = save_tiny("qwen3", path, 11, num_hidden_layers=3)
    return str(path), [hf_greedy(model, p, NEW) for p in PROMPTS]


# ---- pure parts ------------------------------------------------------------------------------------
def test_series_names_and_errors():
    """A family says which leaves a series name is; a name it does not have, or one some layers lack, is refused."""
    qwen2 = dataclasses.replace(DENSE, architecture="Qwen2ForCausalLM", qkv_bias=True, qk_norm=False)
    assert series_leaves(DENSE, layer_shard("o_proj,down_proj")).leaves == ("o_proj", "down")
    assert series_leaves(DENSE, layer_shard(["q_proj"], "tp")) == LayerShard("tp", ("qkv",))  # GQA's fused qkv
    assert series_leaves(qwen2, layer_shard("q_proj")).leaves == ("qkv", "qkv_bias")  # ... and its bias
    assert series_leaves(MLA, layer_shard("q_b_proj,kv_b_proj,o_proj")).leaves == ("q_b_proj", "kv_b_proj", "o_proj")
    assert series_leaves(DENSE, layer_shard("layer")).leaves == (
        "attn_norm", "qkv", "q_norm", "k_norm", "o_proj", "mlp_norm", "gate_up", "down"
    )  # fmt: skip
    assert "gate_up" not in series_leaves(MOE, layer_shard("layer")).leaves  # MoE layers hold experts instead
    with pytest.raises(ValueError, match=r"layer_shard: a Qwen3ForCausalLM has no series \['q_b_proj'\]; choose from "):
        series_leaves(DENSE, layer_shard("o_proj,q_b_proj"))
    with pytest.raises(ValueError, match=r"series \['gate_up'\] are not in every layer of this Qwen3MoeForCausalLM"):
        series_leaves(MOE, layer_shard("gate_up"))  # MoE layers hold experts instead of a dense MLP
    with pytest.raises(ValueError, match=r"series \['q_proj'\] are not in every layer of this DeepseekV3ForCausalLM"):
        series_leaves(MLA, layer_shard("q_proj,o_proj"))  # a low-rank query: q_a_proj and q_b_proj
    with pytest.raises(ValueError, match=r"expected series names like 'o_proj,down_proj' or 'layer', got ','"):
        layer_shard(",")
    with pytest.raises(ValueError, match=r"\['down_proj'\] are not leaves every layer has"):
        stack_series(llama.init_params(DENSE), layer_shard("down_proj"))  # an alias must be resolved first
    cfg = llama.LlamaConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        qk_norm=True,
    )
    with pytest.raises(
        ValueError,
        match=r"layer_shard: series 'o_proj' is already sharded over mesh axis 'tp'; "
        r"layer-shard it over an axis it is replicated on \(dp\)",
    ):
        check_plan(cfg, Mesh.abstract({"dp": 2, "tp": 2}), Plan(layer_shard=layer_shard("o_proj", "tp")))
    with pytest.raises(ValueError, match=r"layer_shard axis 'pp' is not an axis of the mesh \{'dp': 2, 'tp': 1\}"):
        check_plan(cfg, Mesh.abstract({"dp": 2, "tp": 1}), Plan(layer_shard=layer_shard("o_proj", "pp")))


@given(
    layers=st.integers(1, 9),
    n=st.integers(1, 5),
    tp=st.sampled_from([1, 2]),
    series=st.sampled_from(["o_proj,down_proj", "layer", "q_proj,gate_up"]),
)
def test_shard_of_stacked_series_holds_layer_l_on_coordinate_l_mod_n(layers, n, tp, series):
    cfg = llama.LlamaConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        qkv_bias=True,
    )
    ls = series_leaves(cfg, layer_shard(series, "dp"))
    full = llama.init_params(cfg, seed=layers)
    stacked = stack_series(full, ls)
    specs = series_specs(llama.param_specs(cfg), ls, layers)
    mesh = Mesh.abstract({"dp": n, "tp": tp})
    locals_ = [shard(stacked, specs, mesh, coordinate=r) for r in range(n * tp)]
    for r, local in enumerate(locals_):
        c, t = divmod(r, tp)
        per_layer = shard(full, llama.param_specs(cfg), mesh, coordinate=r)
        for leaf, x in local["series"].items():
            mine = owned_layers(layers, n, c)
            assert x.shape[0] == len(mine) == math.ceil(max(layers - c, 0) / n)
            for j, li in enumerate(mine):
                assert torch.equal(x[j], per_layer["layers"][li][leaf])
        assert all(leaf not in layer for layer in local["layers"] for leaf in local["series"])
    back = dict(flatten_with_paths(unstack_series(unshard(locals_, specs, mesh))))
    want = dict(flatten_with_paths(full))
    assert back.keys() == want.keys() and all(torch.equal(back[p], want[p]) for p in want)


# ---- loading: only owned layers are read -------------------------------------------------------------
@pytest.mark.parametrize("n,tp", [(2, 1), (4, 2), (8, 1)])
def test_load_reads_only_owned_layers(qwen3, n, tp):
    ls = LayerShard("dp", ("o_proj", "down"))  # "o_proj,down_proj", resolved
    mesh = Mesh.abstract({"dp": n, "tp": tp})
    full = load_checkpoint(qwen3[0], mesh.at(0))
    full_stacked = stack_series(shard(full, llama.param_specs(full.config), mesh.at(0)), ls) if tp == 1 else None
    for r in range(n * tp):
        c = r // tp
        names: list[str] = []
        plan = Plan(layer_shard="o_proj,down_proj")
        local = load_checkpoint(qwen3[0], mesh.at(r), plan, on_read=lambda name, _: names.append(name))
        read_layers = {int(x.split(".")[2]) for x in names if ".o_proj." in x or ".down_proj." in x}
        assert read_layers == set(owned_layers(LAYERS, n, c))
        assert local["series"]["o_proj"].shape[0] == len(owned_layers(LAYERS, n, c))
        assert local.placement.plan.layer_shard == ls and "o_proj" not in local["layers"][0]
        if full_stacked is not None and c == 0:
            assert torch.equal(local["series"]["down"], full_stacked["series"]["down"][0::n])


# ---- multi-rank: parity with transformers, schedule, memory ------------------------------------------
CASES = [  # (world, axes, series, k, backend): compiled where the graph differs (tp inside, with prefetch); the
    # whole-layer series compiles in the hazard tests below, prefetch over dp alone in the ring and saved-graph tests
    # (logits under inductor, transformers' tokens under aot_eager), and compiling costs CI time
    (2, {"dp": 2, "tp": 1}, "layer", 2, "none"),
    (2, {"dp": 2, "tp": 1}, "o_proj,down_proj", 0, "none"),
    (4, {"dp": 2, "tp": 2}, "q_proj,down_proj", 1, "inductor"),
    (4, {"dp": 4, "tp": 1}, "o_proj,down_proj", 2, "none"),
    (4, {"dp": 4, "tp": 1}, "gate_up", 0, "none"),
    (4, {"dp": 4, "tp": 1}, "layer", 1, "none"),
]


@pytest.mark.parametrize(
    "world,axes,series,k,backend", CASES, ids=[f"dp{c[1]['dp']}tp{c[1]['tp']}-{c[2]}-k{c[3]}-{c[4]}" for c in CASES]
)
def test_layer_sharded_generation_matches_transformers(request, qwen3, world, axes, series, k, backend):
    world_ = request.getfixturevalue(f"world{world}")
    results = world_.run(generate_layer_sharded, qwen3[0], axes, series, k, PROMPTS, NEW, backend)
    n = axes["dp"]
    for rank, (tokens, shapes, resident, state, replicated, seen) in enumerate(results):
        assert tokens == qwen3[1], f"rank {rank}"
        assert_every_write_delivered(seen, seen["groups"], LAYERS, replicated, NEW)
        c = rank // axes["tp"]
        assert all(s[0] == len(owned_layers(LAYERS, n, c)) for s in shapes.values())
        # resident series bytes (owned layers + the ring of k + 1 slots) within (ceil(L/n) + k + 1) / L of what
        # this rank would hold replicated; exactly the owned layers plus k + 1 slots of one layer each
        per_layer = replicated // LAYERS
        assert resident + state == (len(owned_layers(LAYERS, n, c)) + (k + 1 if backend != "none" else 0)) * per_layer
        assert resident + state <= series_bound(LAYERS, n, k) * replicated


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """A 4-layer tiny Qwen3-MoE saved by transformers, and its greedy tokens for PROMPTS."""
    path = tmp_path_factory.mktemp("qwen3_moe_ls")
    model = save_tiny_moe("qwen3_moe", path, 12, num_hidden_layers=4)
    return str(path), [hf_greedy(model, p, NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A 4-layer tiny Mixtral saved by transformers, and its greedy tokens for PROMPTS."""
    path = tmp_path_factory.mktemp("mixtral_ls")
    model = save_tiny_moe("mixtral", path, 13, num_hidden_layers=4)
    return str(path), [hf_greedy(model, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("family,backend", [("qwen3_moe", "none"), ("mixtral", "inductor")])
def test_moe_attention_projections_layer_sharded_match_transformers(request, world2, family, backend):
    """The MoE families run through the same layer loop: their attention projections layer-shard and prefetch too,
    eager and compiled (the dense-MLP series are absent from MoE layers, so "layer" takes only the leaves every
    layer has)."""
    path, ref = request.getfixturevalue(family)
    results = world2.run(generate_layer_sharded, path, {"dp": 2, "tp": 1}, "q_proj,o_proj", 1, PROMPTS, NEW, backend)
    for rank, (tokens, shapes, _, _, replicated, seen) in enumerate(results):
        assert tokens == ref, f"rank {rank}"
        assert_every_write_delivered(seen, seen["groups"], 4, replicated, NEW)
        assert set(shapes) == {"qkv", "o_proj"} and all(s[0] == 2 for s in shapes.values())
    qwen3_moe = request.getfixturevalue("qwen3_moe")
    ls = layer_shard("layer", "dp")
    moe_cfg = load_checkpoint(qwen3_moe[0], Mesh.abstract({"tp": 1}, 0)).config
    meta, _ = check_plan(moe_cfg, Mesh.abstract({"dp": 2, "tp": 1}), Plan(layer_shard=ls))
    assert set(meta["series"]) == {"attn_norm", "qkv", "q_norm", "k_norm", "o_proj", "mlp_norm"}


def test_ring_logits_equal_the_unsharded_model_on_gloo(world2, qwen3_3l):
    """The compiled step (AOT-functionalized: the ring writes as auto_functionalized, then run) over several steps:
    the logits of the layer-sharded model at k = 2 (3 layers: one phase) and k = 1 (k + 1 = 2 does not divide L, so
    the ring goes through 2 phases, a graph each) equal the unsharded model's; the ring keeps its tensors from step
    to step. And once through inductor (k = 1), whose reinplace pass writes the slots in place and whose order is
    its own. Every ring write, from new_state to the drain, delivers its layer (counted inside aot_eager's
    auto_functionalized writes too). (k = 0 and 2 run compiled on 6 layers in the hazard tests below, and eagerly in
    the generation cases above.)"""
    axes, extra = {"dp": 2, "tp": 1}, ((1, "inductor"),)
    results = world2.run(ring_logits, qwen3_3l[0], axes, "o_proj,down_proj", (2, 1), 4, "aot_eager", extra)
    for rank, by_k in enumerate(results):
        assert set(by_k) == {1, 2, (1, "inductor")}
        for k, (diff, same, buffers, seen) in by_k.items():
            slots = (k[0] if isinstance(k, tuple) else k) + 1
            assert diff <= 1e-5 and same and buffers == slots, (rank, k, diff, same, buffers)
            assert_every_write_delivered(seen, seen["groups"], 3, seen["per_forward"], seen["forwards"])


MEMORY_PRESERVING = ("reorder_communication_preserving_peak_memory", "sink_waits_iterative", "raise_comms")


@pytest.mark.parametrize(
    "series,k,passes",
    [("o_proj", 0, None), ("o_proj,down_proj", 1, MEMORY_PRESERVING), ("layer", 2, None)],
    ids=["o_proj-k0", "o_proj,down_proj-k1-inductor-comm-passes", "layer-k2"],
)
def test_compiled_ring_is_hazard_free_with_nothing_allocated(world2, qwen3, series, k, passes):
    """The compiled step writes every layer into a ring slot it is given (a graph input), in place: after inductor's
    reinplace pass, one write per layer straight into a graph input, no functional broadcast or
    ``auto_functionalized`` left (either would allocate a buffer in the graph), no copy back into a slot; the
    hazard check holds over the functionalized graph's partial order and over inductor's final order (after its
    own passes: reorder_for_peak_memory, on by default, the sink_waits pass compile_model asks for, and in one
    case the memory-preserving comm passes instead), each slot bound by its input index and each read to the layer
    of the compute around it. At k = 0, inductor's code with layer 1's write moved before layer 0's read is caught
    (a total order: as the right layer and a read before its wait)."""
    args = (qwen3[0], {"dp": 2, "tp": 1}, series, k, "inline", False, passes)
    for rank, (fx, ind, facts) in enumerate(world2.run(ring_hazards, *args)):
        assert fx == [] and ind == [], (rank, fx, ind)
        assert facts["writes"] == LAYERS and facts["functional"] == 0 and facts["copies_into_slots"] == [], facts
        assert facts["into_inputs"] and len(facts["written"]) == k + 1, facts
        assert facts["fx_read_layers"] == list(range(LAYERS))  # every read of the FX graph names its layer
        program = from_inductor_code(facts["code"], k, inputs=facts["inputs"])
        labelled = {layer for _, layer in program.reads.values() if layer is not None}
        assert set(range(1 if series == "layer" else 0, LAYERS)) <= labelled, labelled  # (*)
        if k == 0:
            moved = _write_moved_before_read(facts["code"], "arg5_1")
            found = check(from_inductor_code(moved, 0, inputs=facts["inputs"]), 0, 1)
            assert len(found) == 2 and re.fullmatch(
                r"read before write: \d+:extern_kernels\.mm\(.* reads arg5_1 with no wait after "
                r"\d+:torch\.ops\.functional_npu\.broadcast_into\.default\(arg5_1, .*, which writes it",
                found[0],
            ), found
            assert re.fullmatch(
                r"the right layer: \d+:extern_kernels\.mm\(.* reads layer 0 from arg5_1 \(ring slot 0\), which holds "
                r"layer 1 then",
                found[1],
            ), found


# (*) the whole-layer series leaves layer 0 no per-layer input of its own but its KV cache, which inductor's first
# kernel touches with every layer's (torch 2.13): there its reads may name no layer, and are then not checked for it
# (the FX graph's are)


def _write_moved_before_read(code: str, slot: str) -> str:
    """Inductor's code with its second ring write (layer 1 at k = 0) moved to just before the first line that reads
    ``slot`` (layer 0's read)."""
    lines = code.splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if "def call(self, args):" in ln)
    writes = [i for i in range(start, len(lines)) if "functional_npu.broadcast_into.default(" in lines[i]]
    read = next(
        i
        for i in range(writes[0] + 1, len(lines))
        if re.search(rf"\b{slot}\b", lines[i]) and "wait_tensor" not in lines[i] and "broadcast_into" not in lines[i]
    )
    moved = lines.pop(writes[1])
    lines.insert(read, moved)
    return "".join(lines)


def test_inductors_default_order_hoists_the_wait_and_fails_the_overlap_check(world2, qwen3):
    """Without the sink_waits pass inductor puts each wait right after its write: every slot access is still ordered,
    but the step stalls until each layer arrives. The overlap check finds it, for every layer read in the step (the
    prefetch benchmark measured 85% of the communication exposed at k = 1 in that order, 12% with the waits sunk)."""
    for fx, ind, _ in world2.run(ring_hazards, qwen3[0], {"dp": 2, "tp": 1}, "o_proj", 1, "inline", False, ()):
        overlap = r"overlap: \d+:torch\.ops\.functional_npu\.broadcast_into\.default\(arg\d+_1, .* \(layer (\d+)\) "
        found = [
            re.fullmatch(overlap + r"is waited on before any earlier layer's reads can run alongside it", v)
            for v in ind
        ]
        assert fx == [] and all(found) and [int(m.group(1)) for m in found] == list(range(1, LAYERS)), (fx, ind)


def test_unordered_ring_writes_fail_the_check(world2, qwen3):
    """The control: without the gate, a ring write is unordered with the reads of the layer its slot held (over the
    FX graph's data edges, a partial order)."""
    war = r"write after read: auto_functionalized_v2(_\d+)? writes (arg\d+_1) unordered with (mm_\d+), which reads it"
    for fx, _, _ in world2.run(ring_hazards, qwen3[0], {"dp": 2, "tp": 1}, "o_proj", 1, "unordered"):
        found = [re.fullmatch(war, v) for v in fx]
        assert fx and all(found), fx
        # each slot's every read races a later write into it: (L + k - 1) writes after layer 0, over 2 slots
        assert len({m.group(3) for m in found}) == LAYERS - 1, fx


def test_a_compiler_that_copies_slots_back_gets_the_hand_over_waited(world2, qwen3):
    """A compiler that does not reinplace (aot_eager) copies each slot's last version back into its input at the
    end of the graph: the next step's layers, handed over in flight, would be copied while still arriving (read
    before write). Its hints wait for them at the end of the step instead, and the check holds."""
    axes = {"dp": 2, "tp": 1}
    rbw = r"read before write: copy_back:(arg\d+_1) reads \1 with no wait after auto_functionalized_v2_\d+, which "
    rbw += "writes it"
    for fx, _, _ in world2.run(ring_hazards, qwen3[0], axes, "o_proj", 2, "inline", True):
        assert len(fx) == 2 and all(re.fullmatch(rbw, v) for v in fx), fx
    for fx, _, _ in world2.run(ring_hazards, qwen3[0], axes, "o_proj", 2, "copy-back", True):
        assert fx == [], fx


def _present(series):
    layer = llama.abstract_params(_qwen3_cfg())["layers"][0]
    return [leaf for leaf in series_leaves(_qwen3_cfg(), layer_shard(series)).leaves if leaf in layer]


def _qwen3_cfg():
    return llama.LlamaConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        qk_norm=True,
    )


def test_prefetch_step_errors(qwen3):
    mesh = Mesh.abstract({"dp": 2, "tp": 1}, 0)
    params = load_checkpoint(qwen3[0], mesh, Plan(layer_shard=layer_shard("o_proj")))
    with pytest.raises(
        ValueError,
        match=r"prefetch_step must be an int with 0 <= k <= num_layers - 1 = 5 \(the model has 6 layers, .*got 6",
    ):
        compile_model(params, mesh, plan=dataclasses.replace(params.placement.plan, prefetch_step=6))
    with pytest.raises(ValueError, match=r"got -1"):
        compile_model(params, mesh, plan=dataclasses.replace(params.placement.plan, prefetch_step=-1))
    model = compile_model(params, mesh, plan=dataclasses.replace(params.placement.plan, prefetch_step=1))
    with pytest.raises(
        ValueError, match=r"prefill: a model compiled with prefetch_step=1 needs a state from new_state\(\)"
    ):
        model.prefill([[1, 2]], init_state(model.config, model.mesh, 1, model.max_seq_len))
    assert (
        resident_bytes({"a": params["series"]["o_proj"], "b": params["series"]["o_proj"][1:]})
        == params["series"]["o_proj"].numel() * 4
    )


def test_each_graph_sees_its_ring_slots_at_one_address_over_many_steps(world2, qwen3_3l):
    """The ring's list never turns: over 2(k + 1) decode steps every graph is called with one tuple of ring-slot
    addresses (what a captured graph records once and a replay needs unchanged), and the decode graphs number the
    ring's phases, (k + 1) / gcd(L, k + 1) (2 at k = 1 with L = 3, 5 at k = 4 with L = 6), each reading the slots in
    its own roles (k = 1, L = 3 here). The counterexample, the list turned between steps as before, gives one decode
    graph called with as many address tuples as there are phases (each a recapture on a device), though its logits
    are the same."""
    from functional_npu.parallel.prefetch_ring import phases

    k = 1
    steps = 2 * (k + 1)
    qwen3 = qwen3_3l
    (graphs, logits), _ = world2.run(ring_addresses, qwen3[0], {"dp": 2, "tp": 1}, "o_proj,down_proj", k, steps)
    prefill, *decodes = graphs
    assert len(decodes) == phases(3, k) == 2
    assert [len(calls) for calls in graphs] == [1] * len(graphs), graphs  # one address tuple per graph
    assert len({calls[0] for calls in graphs}) == 1  # the same tensors at the same inputs, in every phase's graph
    (old_graphs, old_logits), _ = world2.run(
        ring_addresses, qwen3[0], {"dp": 2, "tp": 1}, "o_proj,down_proj", k, steps, True
    )
    _, old_decode = old_graphs
    assert len(old_decode) == phases(3, k)  # one graph, replayed on every turn of the list
    assert torch.equal(old_logits, logits)


def test_a_ring_with_more_graphs_than_the_budget_is_refused_naming_k_and_l(qwen3):
    """k = 4 over 6 layers: 5 phases; with 13 batch buckets and 3 prefill lengths, 5 x 52 = 260 graphs > 256, refused
    before anything compiles; k = 2 (k + 1 divides 6: one phase) compiles with the same buckets."""
    mesh = Mesh.abstract({"dp": 2, "tp": 1}, 0)
    params = load_checkpoint(qwen3[0], mesh, Plan(layer_shard=layer_shard("o_proj")))
    shapes = dict(backend="inductor", batch_sizes=list(range(1, 14)), prefill_lengths=[8, 16, 32], max_seq_len=64)
    plan = params.placement.plan
    with pytest.raises(
        ValueError,
        match=r"compile_model: prefetch_step 4 over 6 layers turns a ring of 5 slots through 5 phases, one graph each: "
        r"5 x 52 shapes = 260 graphs, over the budget of 256; use a prefetch_step k with k \+ 1 dividing 6 \(one "
        r"phase: k in \[0, 1, 2, 5\]\)",
    ):
        compile_model(params, mesh, plan=dataclasses.replace(plan, prefetch_step=4), **shapes)
    compile_model(params, mesh, plan=dataclasses.replace(plan, prefetch_step=2), **shapes)  # traced lazily: no cost


def test_saved_graphs_are_one_per_shape_and_phase_and_load_warm(world2, qwen3_3l, tmp_path):
    """compile_model(cache_dir=...) with a ring of 2 phases (k = 1, L = 3): the decode graph of each phase is saved
    under its own name and loaded by the next compile, which compiles nothing and gives transformers' tokens."""
    qwen3 = qwen3_3l
    results = world2.run(ring_saved_graphs, qwen3[0], str(tmp_path / "cache"), 1, PROMPTS[:1], 4)
    names = ["forward-1x4-last", "forward-1x1-phase1", "forward-1x1"]
    for rank, ((cold, loaded_cold, compiled), (warm, loaded, compiled_warm)) in enumerate(results):
        assert cold == warm == [qwen3[1][0][:4]], rank
        assert (loaded_cold, compiled) == ([], names) and (loaded, compiled_warm) == (names, []), (rank, compiled)
