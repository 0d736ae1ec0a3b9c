"""Golden captured graphs: the artifacts of every case whose key changed (its sources, torch's version) regenerated --
the aten graphs and, through torchair's own converters, the GE graphs, through npugraph_ex's passes the ACL graphs --
and compared with graphs/ (drift must be regenerated and reviewed); every case's stored artifacts checked."""

import json
import re
import shutil

import pytest

from functional_npu.models import gemma3, llama, moe
from tools.aten_graphs import (
    CASES,
    GRAPH_CONFIGS,
    GRAPH_QUANTS,
    LAYER_SHARD_LAYERS,
    LAYER_SHARD_STEPS,
    PHASES,
    TP_SIZES,
    TRAIN,
    TRAIN_FAMILIES,
    read_artifact,
)
from tools.ge_graphs import CONTROL, compare_schedules
from tools.graph_keys import KEYS_FILE, ROOT, case_key, read_keys, stale, write_keys
from tools.graphs import current_keys, main, regenerate

from ..support import GRAPHS, golden


@pytest.fixture(scope="module")
def stale_cases():
    return stale(GRAPHS, current_keys())


@pytest.fixture(scope="module")
def report(request, stale_cases):
    """The cases whose key changed, regenerated and compared (none: nothing to run, the stored artifacts stand)."""
    world = request.getfixturevalue("world2") if stale_cases else None
    return regenerate(GRAPHS, check=True, world=world, names=stale_cases)


@pytest.fixture(scope="module")
def drift(report):
    return report.drift


def test_graphs_match_the_committed_artifacts(report):
    if report.cases:
        assert report.skipped is None, f"the GE conversion must run here: {report.skipped}"
    drifted = report.drift
    assert drifted == [], f"graphs/ drifted from the code; run `python -m tools.graphs` and review: {drifted}"


def test_every_case_has_a_key_and_its_artifacts():
    written = read_keys(GRAPHS)
    assert set(written) == {c.name for c in CASES}, "run `python -m tools.graphs` to record every case's key"
    assert all((GRAPHS / c.name / "graph.txt").is_file() for c in CASES)


def test_a_cases_key_follows_its_own_sources_only():
    def edited(name):
        return lambda f: f.read_bytes() + (b"\nEDITED = 1\n" if f.name == name else b"")

    llama_key = case_key("llama")
    assert case_key("llama", read=edited("deepseek.py")) == llama_key  # another family's module: not an input
    assert case_key("llama", read=edited("llama.py")) != llama_key
    assert case_key("deepseek", read=edited("llama.py")) == case_key("deepseek")  # no family reads another's
    assert case_key("deepseek", read=edited("dense.py")) != case_key("deepseek")  # the dense decoder's ends
    assert case_key("moe", read=edited("collectives.py")) != case_key("moe")  # shared by every family
    assert case_key("llama", read=edited("aten_graphs.py")) != llama_key  # the tools that capture the graph


def test_a_docstring_a_comment_line_or_a_blank_line_changes_no_key():
    """What cannot reach an artifact keys nothing: docstrings, comments on lines of their own, blank lines. A comment
    after code does (the FX graph quotes each traced line whole), and so does any code."""
    file = "decoder.py"

    def edited(old, new):
        return lambda f: f.read_bytes().replace(old, new, 1) if f.name == file else f.read_bytes()

    source = (ROOT / "functional_npu" / "models" / file).read_bytes()
    doc = source.split(b'"""')[1]
    key = case_key("llama")
    assert case_key("llama", read=edited(doc, doc + b" More words.")) == key
    assert case_key("llama", read=edited(b"\nimport ", b"\n# a note\n\n\nimport ")) == key
    code = source[source.index(b"\nimport ") :].splitlines()  # past the module docstring
    line = next(x for x in code if b"  # " in x and not x.strip().startswith((b"#", b'"')))
    assert case_key("llama", read=edited(line, line + b" more")) != key  # a trailing comment: quoted in graph.txt
    assert case_key("llama", read=edited(b"\nimport ", b"\nEDITED = 1\nimport ")) != key


def test_a_stale_case_is_regenerated_and_its_drift_found(tmp_path):
    """A case whose key is wrong is stale; regenerated, it matches its committed artifacts, and a planted edit of them
    is drift (aten only: one rank, seconds)."""
    name = "llama-tp1-decode"
    shutil.copytree(GRAPHS / name, tmp_path / name)
    now = current_keys()
    write_keys(tmp_path, {name: "0" * 24})
    assert stale(tmp_path, {name: now[name]}) == [name]
    assert regenerate(tmp_path, check=True, ge=False, acl=False, names=[name]).drift == []
    graph = tmp_path / name / "graph.txt"
    graph.write_text(graph.read_text().replace("mm", "bmm", 1))
    assert regenerate(tmp_path, check=True, ge=False, acl=False, names=[name]).drift == [f"{name}/graph.txt"]
    assert (tmp_path / KEYS_FILE).is_file() and ROOT.is_dir()


def test_a_damaged_artifact_is_drift_not_a_traceback(tmp_path):
    """A binary file in place of text, a ``.gz`` that is not gzip: drifted (once: a traceback from the check)."""
    from tools.aten_graphs import diff_artifacts

    name = "llama-tp1-decode"
    (tmp_path / name).mkdir()
    (tmp_path / name / "graph.txt").write_bytes(b"\xff\xfe\x00binary")
    (tmp_path / name / "ge_graph.pbtxt.gz").write_bytes(b"not gzip")
    artifacts = {name: {"graph.txt": "graph():\n", "ge_graph.pbtxt.gz": "node {}\n", "summary.json": {"nodes": 1}}}
    assert diff_artifacts(artifacts, tmp_path) == [f"{name}/{f}" for f in artifacts[name]]


def test_the_command_is_python_m_tools_graphs(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--no-such-flag"])
    assert exit_.value.code == 2 and "usage: python -m tools.graphs [-h] [--check] [--all] [--out OUT] [--no-ge]" in (
        capsys.readouterr().err
    )


def test_every_case_converts_to_a_ge_graph_with_its_aten_collective_schedule(report):
    """Zero missing converters, and GE's Hcom ops are the aten collectives, in order, over the same
    ranks and bytes (broadcasts from the same root)."""
    assert report.problems == [], "\n".join(report.problems)
    for case in CASES:
        hcom = read_artifact(GRAPHS, case.name, "ge_hcom.json")
        assert compare_schedules(read_artifact(GRAPHS, case.name, "collectives.json"), hcom) == [], case.name
        census = read_artifact(GRAPHS, case.name, "ge_census.json")
        assert census["NetOutput"] == 1 and census["Data"] > 0, case.name
        text = read_artifact(GRAPHS, case.name, "ge_graph.pbtxt.gz")
        assert 'device_type: "NPU"' in text and 'device_type: "CPU"' not in text, case.name  # meta inputs read NPU
        tp_ops = [h for h in hcom if h["op"] != "HcomBroadcast"]
        assert all("stream" not in h for h in tp_ops), case.name  # only the prefetch takes a side stream


DENSE = [f for f, c in GRAPH_CONFIGS.items() if isinstance(c, (llama.LlamaConfig, gemma3.Gemma3Config))]
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


@pytest.mark.parametrize("k", LAYER_SHARD_STEPS)
def test_layer_sharded_schedule_prefetches_k_layers_ahead(drift, k):
    """o_proj and down over dp = 2: layer l + k's broadcast (both leaves in one buffer) issued as layer l
    starts, layers 0 .. k-1 carried in; src alternates with the owner l % 2; the last k broadcasts fetch
    the next step's and leave the graph in flight."""
    from tools.aten_graphs import LAYER_SHARD_SERIES

    cfg, layers = GRAPH_CONFIGS["qwen3"], LAYER_SHARD_LAYERS
    assert LAYER_SHARD_SERIES == "o_proj,down_proj"
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    for phase in PHASES:
        name = f"qwen3-dp2-layer_shard-k{k}-{phase}"
        schedule = read_artifact(GRAPHS, name, "collectives.json")
        fetched = [(li + k) % layers for li in range(layers)]  # the layer issued as layer li starts
        assert [c["src"] for c in schedule] == [li % 2 for li in fetched]  # from its owner
        # one broadcast per layer: o_proj and down coalesced into one flat buffer
        assert [c["op"] for c in schedule] == ["functional_npu.broadcast_into.default"] * layers
        assert [c["bytes"] for c in schedule] == [4 * (d * h + d * f)] * layers
        assert {c["axis"] for c in schedule} == {"dp"}
        graph = read_artifact(GRAPHS, name, "graph.txt")
        # one wait per layer read in this step, on its ring slot; the last k broadcasts (the next step's) are
        # written into the ring in place (copied into the slot inputs at the end), still in flight
        assert graph.count("= torch.ops._c10d_functional.wait_tensor.default(") == layers
        assert graph.count("torch.ops.higher_order.auto_functionalized_v2(") == layers


@pytest.mark.parametrize("case", [c for c in CASES if c.offload is not None], ids=lambda c: c.name)
def test_host_series_are_copies_into_the_ring_not_collectives(case):
    """Series kept in host memory: each layer's write is a copy of its parts (every offloaded leaf of the layer, in one
    buffer) with a group of one: no collective; beside a layer-sharded series (the mixed case) only its broadcasts
    are collectives, one per layer from the layer's owner."""
    cfg, layers = case.config, case.config.num_layers
    d, h = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    schedule = read_artifact(GRAPHS, case.name, "collectives.json")
    graph = read_artifact(GRAPHS, case.name, "graph.txt")
    copies = re.findall(r"group_name = '', size = 1, .*_all_bases = \[(\w+)\]", graph)
    assert len(copies) == layers and graph.count("wait_tensor.default(") == case.ring_groups * layers
    if case.series is None:
        assert schedule == [] and len(re.findall(r"parts = \[\w+, \w+\]", graph)) == layers  # o_proj and down
        return
    assert [c["bytes"] for c in schedule] == [4 * d * h] * layers and {c["axis"] for c in schedule} == {"dp"}
    assert [c["src"] for c in schedule] == [(li + case.k) % layers % 2 for li in range(layers)]


@pytest.mark.parametrize("k", LAYER_SHARD_STEPS)
def test_ge_graph_keeps_the_ring_safe_in_every_order(report, k):
    """Read from the stored GE graph's partial order (its text, no torchair): the hazard check finds nothing (no write
    into a slot unordered with a read of the layer it held, every read after its broadcast and of its own layer,
    k + 1 slots), every broadcast on the prefetch stream from its owner, and no prefetch buffer allocated inside the
    graph: the slots are RefData inputs."""
    for phase in PHASES:
        name = f"qwen3-dp2-layer_shard-k{k}-{phase}"
        order = golden.ge_ring_check(next(c for c in CASES if c.name == name))  # recomputed from the stored graph
        assert order["ok"] and order["violations"] == [], order["problems"]
        assert read_artifact(GRAPHS, name, "ge_prefetch.json")["ok"]  # the stored verdict agrees
        assert order["ring_slots"] == k + 1 and order["allocated_prefetch_bytes"] == 0
        assert order["broadcasts_count"] == LAYER_SHARD_LAYERS
        rows = order["broadcasts"]
        assert [r["layer"] for r in rows] == list(range(k, LAYER_SHARD_LAYERS + k))
        for r in rows:
            assert r["stream"] == "prefetch" and r["root"] == r["layer"] % LAYER_SHARD_LAYERS % 2
            assert r["slot"].startswith("RefData_")
        census = read_artifact(GRAPHS, name, "ge_census.json")
        assert "Assign" not in census and "Fill" not in census, census  # no copy back, no buffer made


def test_without_the_hints_ge_may_write_a_slot_still_being_read(report):
    """The same graph converted with no ordering hints (the ring's writes without ``after``, no stream scope) fails
    the check: a write into a slot is unordered with the reads of the layer it held. Recomputed from the control's
    stored graph where it is kept (``ge_graph_no_hints.pbtxt.gz``); before that file was kept, from its stored
    verdict (the faults planted in the hinted graphs, tests/npu/test_ge_graph.py, are recomputed)."""
    case = next(c for c in CASES if c.name == CONTROL)
    if (GRAPHS / CONTROL / "ge_graph_no_hints.pbtxt.gz").is_file():
        order = golden.ge_ring_check(case, read_artifact(GRAPHS, CONTROL, "ge_graph_no_hints.pbtxt.gz"))
    else:
        order = read_artifact(GRAPHS, CONTROL, "ge_prefetch_no_hints.json")
    assert not order["ok"]
    assert re.fullmatch(
        r"write after read: (HcomBroadcast|ViewCopy)(_\d)? writes RefData_arg\d+_1 unordered with MatMul(_\d+)?, "
        r"which reads it",
        order["violations"][0],
    ), order["violations"]
    assert all(r["stream"] is None for r in order["broadcasts"])


def _ge_ops(text, op_type):
    """The text of each GE op of ``op_type`` in a graph's protobuf text."""
    return [block for block in text.split("\nop {") if f'\n  type: "{op_type}"\n' in block]  # the op's own type


@pytest.mark.parametrize("quant", GRAPH_QUANTS)
def test_quantized_linears_are_ascends_quantized_matmuls(report, quant):
    """bf16 Qwen3 at tp 2 with every linear but lm_head quantized: each of the 4 linears per layer is one
    Ascend quantized matmul in the GE graph (the dense MatMul left is lm_head), with int8 (W8A8) or int4
    (weight-only, groups of 32) weights; W8A8 rounds each token with the scale of its whole row, so the
    row-parallel o_proj and down take a max all_reduce of the token magnitudes before their sum."""
    cfg = GRAPH_CONFIGS["qwen3"]
    linears = 4 * cfg.num_layers
    op, aten_op = (
        ("QuantBatchMatmulV3", "quant_matmul")
        if quant == "w8a8"
        else ("WeightQuantBatchMatmulV2", "weight_quant_matmul")
    )
    for phase in PHASES:
        name = f"qwen3-tp2-{quant}-{phase}"
        assert read_artifact(GRAPHS, name, "census.json")[f"functional_npu.{aten_op}.default"] == linears
        census = read_artifact(GRAPHS, name, "ge_census.json")
        assert census[op] == linears and census["MatMul"] == 1, census
        text = read_artifact(GRAPHS, name, "ge_graph.pbtxt.gz")
        blocks = _ge_ops(text, op)
        assert len(blocks) == linears
        for block in blocks:
            dtypes = re.findall(r"dtype: (DT_\w+)", block)
            if quant == "w8a8":  # x1, x2 int8 -> bf16 output, the scales float32
                assert dtypes[:2] == ["DT_INT8", "DT_INT8"] and dtypes[-1] == "DT_BF16", dtypes
                assert "DT_FLOAT" in dtypes
            else:  # bf16 x, int4 weight (bitcast from the packed words), bf16 scale and offset
                assert dtypes[:4] == ["DT_BF16", "DT_INT4", "DT_BF16", "DT_BF16"] and dtypes[-1] == "DT_BF16", dtypes
                assert re.search(r'key: "antiquant_group_size"\s+value \{\s+i: 32', block)
        schedule = read_artifact(GRAPHS, name, "collectives.json")
        reduces = [c.get("reduce") for c in schedule if "all_reduce" in c["op"]]
        row_parallel = ["max", "sum"] if quant == "w8a8" else ["sum"]
        assert reduces == ["sum"] + row_parallel * (2 * cfg.num_layers), reduces


def test_module_tp_composed_with_layer_sharding_schedule(report):
    """dp 4 split (dp 2, dp2 2), every module TP'd over dp2, o_proj and down also layer-sharded over the outer
    dp (prefetch k = 1): in program order the embedding's id gather and reduce-scatter; per layer o_proj's
    head-slice all_to_all and reduce-scatter, the MLP's gather and reduce-scatter; the head's gather and
    vocab-slice all_to_all (one position per row), all over dp2 and moving only the bytes the plan says; the
    prefetch broadcasts over dp; and GE keeps the prefetch bounds (k + 1 buffers)."""
    from tools.aten_graphs import MODULE_TP, MODULE_TP_DP

    cfg, layers = GRAPH_CONFIGS["qwen3"], LAYER_SHARD_LAYERS
    assert MODULE_TP == dict.fromkeys(("o_proj", "lm_head", "embed", "mlp"), 2) and MODULE_TP_DP == 4
    for phase, (b, s) in PHASES.items():
        name = f"qwen3-dp4-module_tp-layer_shard-k1-{phase}"
        schedule = read_artifact(GRAPHS, name, "collectives.json")
        module_ops = [(c["op"].split(".")[1], c["axis"], c["bytes"]) for c in schedule if "broadcast" not in c["op"]]
        act, heads = 4 * b * s, cfg.num_heads * cfg.head_dim  # fp32 bytes per feature of this rank's rows
        last = 4 * b  # the head's rows: one position per sequence (a prefill's last token, a decode step's only)
        layer = [
            ("all_to_all_single", "dp2", act * heads),  # o_proj: 2 head slices of this rank's rows
            ("reduce_scatter_tensor", "dp2", 2 * act * cfg.hidden_size),  # the group's rows' partial sums
            ("all_gather_into_tensor", "dp2", act * cfg.hidden_size),  # mlp
            ("reduce_scatter_tensor", "dp2", 2 * act * cfg.hidden_size),
        ]
        assert module_ops == [
            ("all_gather_into_tensor", "dp2", 8 * b * s),  # the ids
            ("reduce_scatter_tensor", "dp2", 2 * act * cfg.hidden_size),
            *layer * layers,
            ("all_gather_into_tensor", "dp2", last * cfg.hidden_size),  # head: hidden states, then vocab slices
            ("all_to_all_single", "dp2", 2 * last * cfg.vocab_size // 2),
        ], name
        broadcasts = [c for c in schedule if "broadcast" in c["op"]]
        assert len(broadcasts) == layers and {c["axis"] for c in broadcasts} == {"dp"}
        order = golden.ge_ring_check(next(c for c in CASES if c.name == name))  # recomputed from the stored graph
        assert order["ok"] and order["ring_slots"] == 2 and order["allocated_prefetch_bytes"] == 0, order["problems"]
        census = read_artifact(GRAPHS, name, "ge_census.json")
        assert census["HcomAllToAllV"] == layers + 1 and census["HcomReduceScatter"] == 2 * layers + 1


def test_deepseek_graphs_attend_in_the_latent_space_when_decoding(report):
    """DeepSeek-V3 (MLA, a dense first layer, an MoE layer with shared experts, experts over tp): the decode graph
    attends through the absorbed path and the prefill graph through the expanded keys; the latent cache is one
    [B, 1, C, R] and one [B, 1, C, dr] buffer per layer; sigmoid routing converts to GE (TopKV2, Sigmoid); the
    tp schedule is the plan's: embedding, o_proj and the dense MLP's all_reduce, the experts' exchange, the
    shared experts' all_reduce, the head's gather."""
    cfg = GRAPH_CONFIGS["deepseek_v3"]
    b, cache = PHASES["decode"][0], 32
    for phase, path in (("decode", "_absorbed"), ("prefill", "_plain")):
        for tp in TP_SIZES:
            name = f"deepseek_v3-tp{tp}-{phase}"
            graph = read_artifact(GRAPHS, name, "graph.txt")
            other = "_plain" if path == "_absorbed" else "_absorbed"
            assert f"# in {path}," in graph and f"# in {other}," not in graph, name
            assert f'"f32[{b}, 1, {cache}, {cfg.kv_lora_rank}]"' in graph, name  # the latent cache, not per head
            census = read_artifact(GRAPHS, name, "ge_census.json")
            assert census["Sigmoid"] >= 1 and census["TopKV2"] >= 2, name
    moe_ops = {"prefill": ["all_to_all_single"] * 3, "decode": ["all_gather_into_tensor", "reduce_scatter_tensor"]}
    for phase in PHASES:
        ops = [c["op"].split(".")[1] for c in read_artifact(GRAPHS, f"deepseek_v3-tp2-{phase}", "collectives.json")]
        dense_layer = ["all_reduce", "all_reduce"]  # o_proj, down
        moe_layer = ["all_reduce", *moe_ops[phase], "all_gather_into_tensor", "all_reduce"]  # o_proj, experts, shared
        assert ops == ["all_reduce", *dense_layer, *moe_layer, "all_gather_into_tensor"], phase


def _transpose(c: dict) -> tuple:
    """A collective's backward, as the schedule records it (op, bytes of its input, reduction): a gather of ``b``
    bytes per rank is reduce-scattered from ``2 b`` (tp 2), all-reduces and all-to-alls keep their size."""
    op = c["op"].split(".")[1]
    if op == "all_gather_into_tensor":
        return ("reduce_scatter_tensor", 2 * c["bytes"], "sum")
    if op == "reduce_scatter_tensor":
        return ("all_gather_into_tensor", c["bytes"] // 2, None)
    return (op, c["bytes"], c.get("reduce"))


def _entry(c: dict) -> tuple:
    return (c["op"].split(".")[1], c["bytes"], c.get("reduce"))


@pytest.mark.parametrize("family", TRAIN_FAMILIES)
def test_train_step_schedule_is_the_forward_then_its_transposes(drift, family):
    """The joint graph of forward, backward and update at tp 2: the prefill graph's collectives (same batch and
    length; the head's, the last, at every position, as the loss reads them, where the prefill takes one position per
    row: S times its bytes), then each one's transpose in reverse order, then the loss's mean, one all_reduce per leaf
    replicated
    over tp (its bytes: the leaves the plan replicates, counted from the layouts), the gradient norm's sum and the
    finiteness flags' max (one float per trained leaf)."""
    from functional_npu.core.tree import flatten_with_paths
    from functional_npu.models import family_of

    cfg, case = GRAPH_CONFIGS[family], next(c for c in CASES if c.name == f"{family}-tp2-train")
    assert TRAIN == PHASES["prefill"]
    forward = read_artifact(GRAPHS, f"{family}-tp2-prefill", "collectives.json")
    assert forward[-1]["op"].split(".")[1] == "all_gather_into_tensor"  # the vocab-parallel head's logits
    forward = forward[:-1] + [forward[-1] | {"bytes": forward[-1]["bytes"] * TRAIN[1]}]
    train = read_artifact(GRAPHS, case.name, "collectives.json")
    n = len(forward)
    assert [_entry(c) for c in train[:n]] == [_entry(c) for c in forward]
    assert [_entry(c) for c in train[n : 2 * n]] == [_transpose(c) for c in reversed(forward)]
    model = family_of(cfg)
    meta, specs = model.abstract_params(cfg, case.plan), model.param_specs(cfg, case.plan)
    layouts = dict(flatten_with_paths(specs, is_leaf=lambda x: hasattr(x, "dims")))
    trained = [(p, x) for p, x in flatten_with_paths(meta) if x.dtype.is_floating_point]
    replicated = sorted(x.numel() * 4 for p, x in trained if "tp" not in _layout_of(layouts, p).axes())
    rest = [_entry(c) for c in train[2 * n :]]
    assert rest[0] == ("all_reduce", 4, "sum") and rest[-2] == ("all_reduce", 4, "sum")
    assert sorted(b for _, b, _ in rest[1:-2]) == replicated and {op for op, _, _ in rest[1:-2]} == {"all_reduce"}
    assert rest[-1] == ("all_reduce", 4 * len(trained), "max")
    assert {c["axis"] for c in train} == {"tp"}


def _layout_of(layouts: dict, path: str):
    while path not in layouts:  # a spec tree may be a prefix of the params tree
        path = path.rsplit(".", 1)[0]
    return layouts[path]
