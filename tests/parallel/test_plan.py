"""The parallel plan as one value: built from Python, a dict or JSON alike; checked once against the model and
the mesh, with one line naming the field, the sizes and a fix; shown as a table of leaves, layouts and bytes."""

import dataclasses
import json
import math
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from functional_npu import LayerShard, Mesh, ModuleTP, Plan, check_plan, compile_model, layer_shard, shard
from functional_npu.models import family_of, llama, moe
from functional_npu.placement import place, plan_table, read_placement

from ..support.configs import DENSE, MLA, MOE

AXES = ("dp", "tp", "ep")


@st.composite
def plans(draw):
    """Any well-formed plan over the axes ``AXES`` (whether it fits a model is the check's business)."""
    module_tp = {
        m: tuple(draw(st.lists(st.sampled_from(("dp", "dp2")), max_size=2, unique=True)))
        for m in "o_proj,lm_head,embed,mlp".split(",")
    }
    series = draw(
        st.lists(
            st.sampled_from(["o_proj", "down_proj", "q_proj", "layer", "gate_up", "kv_b_proj"]),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    return Plan(
        tp=draw(st.sampled_from(AXES)),
        expert_axes=tuple(draw(st.lists(st.sampled_from(AXES), max_size=2, unique=True))),
        num_slots=draw(st.none() | st.integers(1, 64)),
        max_copies=draw(st.integers(1, 4)),
        dispatch_threshold=draw(st.integers(0, 64)),
        module_tp=ModuleTP(**module_tp),
        layer_shard=draw(st.none() | st.just(layer_shard(series, draw(st.sampled_from(AXES))))),
        prefetch_step=draw(st.sampled_from(["auto", 0, 1, 2, 7])),
        prefetch_budget=draw(st.none() | st.floats(1.0, 1e12)),
        absorb=draw(st.booleans()),
        mla_cache=draw(st.sampled_from(["latent", "heads"])),
        invariant=draw(st.sampled_from([False, True, "batch", "portable"])),
        model=draw(st.none() | st.sampled_from(["Qwen3ForCausalLM", "DeepseekV3ForCausalLM"])),
    )


@given(plans())
def test_a_plan_survives_dict_and_json_and_is_hashable(plan):
    assert Plan.from_dict(plan.to_dict()) == plan
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert hash(plan) == hash(Plan.from_dict(plan.to_dict()))
    assert dataclasses.replace(plan, dispatch_threshold=3).layout_key() == plan.layout_key()  # decides no layout


def test_one_setter_normalizes_what_it_is_given():
    plan = dataclasses.replace(Plan(), expert_axes="dp", module_tp={"o_proj": "dp2"}, layer_shard="o_proj,down")
    assert plan.expert_axes == ("dp",) and plan.module_tp == ModuleTP(o_proj=("dp2",))
    assert plan.layer_shard == LayerShard("dp", ("o_proj", "down"))
    assert Plan(layer_shard={"axis": "tp", "series": "layer"}).layer_shard.axis == "tp"
    text = str(plan)
    assert "o_proj over ('dp2',)" in text and "o_proj, down over 'dp'" in text


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tp": ""}, r"Plan.tp must be a mesh axis name such as 'tp', got ''"),
        ({"expert_axes": [1]}, r"Plan.expert_axes must be mesh axis names"),
        ({"max_copies": 0}, r"Plan.max_copies must be an int in \[1, 1048576\], got 0"),
        (
            {"max_copies": 10**30},
            r"Plan.max_copies must be an int in \[1, 1048576\], got 1000000000000000000000000000000",
        ),
        ({"num_slots": 2**62}, r"Plan.num_slots must be an int in \[1, 2147483648\] \(or None"),
        ({"dispatch_threshold": True}, r"Plan.dispatch_threshold must be an int in \[0, 1099511627776\], got True"),
        ({"prefetch_step": "soon"}, r"Plan.prefetch_step must be an int >= 0 or 'auto', got 'soon'"),
        ({"prefetch_budget": -1}, r"Plan.prefetch_budget must be a positive, finite number of bytes"),
        ({"prefetch_budget": float("nan")}, r"Plan.prefetch_budget must be a positive, finite number of bytes"),
        ({"prefetch_budget": float("inf")}, r"Plan.prefetch_budget must be a positive, finite number of bytes"),
        ({"mla_cache": "dense"}, r"Plan.mla_cache must be one of \('latent', 'heads'\), got 'dense'"),
        ({"invariant": "yes"}, r"Plan.invariant must be False, 'batch' .* or 'portable' .*, got 'yes'"),
        ({"module_tp": {"attn": "dp"}}, r"Plan.module_tp: unknown modules \['attn'\]"),
        ({"layer_shard": {"axis": "dp", "leaves": "o_proj"}}, r"Plan.layer_shard: leaves must be a list of series"),
        ({"layer_shard": 3}, r"Plan.layer_shard must be a LayerShard, series names"),
        ({"layer_shard": "o_proj,no-such"}, r"'no-such' is not a name"),
        ({"expert_axes": ("dp", "dp")}, r"Plan.expert_axes names 'dp' more than once \(\('dp', 'dp'\)\); name each"),
        ({"model": ""}, r"Plan.model must be an architecture name such as 'Qwen3ForCausalLM' \(or None: any\), got ''"),
    ],
)
def test_bad_fields_are_one_line_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Plan(**fields)
    with pytest.raises(ValueError, match=r"^p.json: "):  # read from a file: the file names the line
        Plan.from_dict(fields, where="p.json")


def test_a_budget_that_cannot_hold_one_layer_is_refused_before_any_weight_is_read(tmp_path):
    """prefetch_step 'auto' with a budget under one layer of the series: refused from the placement (the CLI) and by
    load_checkpoint before it reads a weight, in the words compile_model used after the load."""
    from functional_npu import load_checkpoint
    from functional_npu.placement.ring_memory import check_ring_budget, one_layer_bytes
    from functional_npu.runtime.loading.save import save_checkpoint

    plan = Plan(layer_shard="o_proj,down_proj", prefetch_step="auto", prefetch_budget=10)
    placed = place(DENSE, {"dp": 2, "tp": 1}, plan)
    h, i = DENSE.hidden_size, DENSE.intermediate_size
    n_heads_dim = DENSE.num_heads * DENSE.head_dim
    layer = (h * n_heads_dim + i * h) * 4  # o_proj and down, whole on the owner (tp 1), float32: counted by hand
    assert one_layer_bytes(placed) == layer and one_layer_bytes(placed, torch.bfloat16) == layer // 2
    message = (
        rf"here: prefetch_step='auto': the prefetch ring budget of 10 bytes does not hold one layer of o_proj,down "
        rf"\({layer} bytes, needed even at k = 0\); raise the budget"
    )
    with pytest.raises(ValueError, match=message):
        check_ring_budget(placed, "here")
    check_ring_budget(place(DENSE, {"dp": 2, "tp": 1}, dataclasses.replace(plan, prefetch_budget=layer)), "here")
    save_checkpoint(family_of(DENSE).init_params(DENSE, seed=0), tmp_path / "ckpt")
    read = []
    with pytest.raises(ValueError, match=message.replace("here", "load_checkpoint")):
        load_checkpoint(
            tmp_path / "ckpt", Mesh.abstract({"dp": 2, "tp": 1}, 0), plan, on_read=lambda *a: read.append(a)
        )
    assert read == []  # nothing read


def test_a_plan_file_is_the_placement_and_reads_back(tmp_path):
    placed = place(DENSE, {"dp": 2, "tp": 2}, Plan(layer_shard="o_proj,down_proj", prefetch_step=1))
    (tmp_path / "p.json").write_text(placed.to_json())
    back = read_placement(tmp_path / "p.json", DENSE)  # the plan now names the model it was made for
    assert back.axes == placed.axes and back.plan == dataclasses.replace(placed.plan, model=DENSE.architecture)
    assert back.to_json() == placed.to_json() and back.layouts == placed.layouts
    data = json.loads(placed.to_json())
    assert data == {"model": DENSE.architecture, "axes": {"dp": 2, "tp": 2}, "plan": data["plan"]}
    assert data["plan"]["layer_shard"] == {"axis": "dp", "leaves": ["o_proj", "down"]}


def test_bad_plan_files_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope.json: no such file; give the path of a plan file"):
        read_placement(tmp_path / "nope.json", DENSE)
    with pytest.raises(ValueError, match=r": not a regular file"):
        read_placement(tmp_path, DENSE)
    os.mkfifo(tmp_path / "fifo")  # no writer: reading it would block forever
    with pytest.raises(ValueError, match=r"fifo: not a regular file"):
        read_placement(tmp_path / "fifo", DENSE)
    for bad in ("", None, b"{}"):
        with pytest.raises(ValueError, match=r"plan file: expected the path of a plan file, got "):
            read_placement(bad, DENSE)
    (tmp_path / "bad.json").write_text("{tp: 1")
    with pytest.raises(ValueError, match=r"bad.json: not JSON \(.* line 1 column 2"):
        read_placement(tmp_path / "bad.json", DENSE)
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"list.json: a plan file is a JSON object with model, axes and plan"):
        read_placement(tmp_path / "list.json", DENSE)
    (tmp_path / "noname.json").write_text(json.dumps({"model": "", "axes": {"tp": 2}, "plan": {}}))
    with pytest.raises(ValueError, match=r"noname.json: model must name the architecture the plan was made for \(e.g"):
        read_placement(tmp_path / "noname.json", DENSE)  # before: "the plan was made for , but this model is ..."
    (tmp_path / "twice.json").write_text(
        '{"model": "Qwen3ForCausalLM", "axes": {"dp": 2, "tp": 1, "dp": 1}, "plan": {}}'
    )
    with pytest.raises(ValueError, match=r"twice.json: the plan file names 'dp' twice in one object \(\{'dp': 1, 'tp'"):
        read_placement(tmp_path / "twice.json", DENSE)  # before: the last 'dp' silently
    (tmp_path / "moe.json").write_text(place(MOE, {"dp": 1, "tp": 2}).to_json())
    with pytest.raises(ValueError, match=r"moe.json: the plan was made for Qwen3MoeForCausalLM, but this model is"):
        read_placement(tmp_path / "moe.json", DENSE)


@pytest.mark.parametrize(
    "cfg, fields, message",
    [
        (DENSE, {"model": "DeepseekV3ForCausalLM"}, r"the plan was made for DeepseekV3ForCausalLM, but this model is "),
        (DENSE, {"expert_axes": ("tp",)}, r"plan.expert_axes=\('tp',\) needs a mixture-of-experts model"),
        (DENSE, {"num_slots": 16}, r"plan.num_slots=16 needs a mixture-of-experts model, but this is a Qwen3"),
        (MOE, {"mla_cache": "heads"}, r"plan.mla_cache='heads' needs multi-head latent attention, .* drop it"),
        (DENSE, {"absorb": False}, r"plan.absorb=False needs multi-head latent attention"),
        (DENSE, {"tp": "mp"}, r"the mesh \{'dp': 2, 'tp': 2\} has no 'mp' axis; add one"),
        (MOE, {"expert_axes": ("ep",)}, r"plan.expert_axes names axis 'ep', but the mesh"),
        (MOE, {"num_slots": 6}, r"plan.num_slots=6 is fewer than the model's 8 experts"),
        (MOE, {"num_slots": 9}, r"plan.num_slots=9 is more than the model's 8 experts x max_copies 1 = 8: some slot"),
        (MOE, {"num_slots": 10**9, "max_copies": 2}, r"plan.num_slots=1000000000 is more than .* use num_slots <= 16"),
        (DENSE, {"layer_shard": layer_shard("o_proj", "pp")}, r"layer_shard axis 'pp' is not an axis of the mesh"),
        (DENSE, {"layer_shard": "q_b_proj"}, r"layer_shard: a Qwen3ForCausalLM has no series \['q_b_proj'\]; choose"),
        (MOE, {"layer_shard": "gate_up"}, r"series \['gate_up'\] are not in every layer .* layer-shard some of"),
        (DENSE, {"layer_shard": "o_proj", "prefetch_step": 4}, r"prefetch_step must be an int with 0 <= k <= "),
        (MOE, {"module_tp": {"o_proj": "dp"}, "expert_axes": ("dp",)}, r"module TP and expert parallelism over"),
    ],
)
def test_a_plan_that_does_not_fit_the_model_or_mesh_is_refused_once_in_one_line(cfg, fields, message):
    with pytest.raises(ValueError, match=message) as e:
        check_plan(cfg, Mesh.abstract({"dp": 2, "tp": 2}), Plan(**fields), where="m")
    assert "\n" not in str(e.value) and str(e.value).startswith("m: ")


def test_a_plan_for_another_model_loads_nothing(tmp_path):
    """The loader checks the plan before opening a weight file: a directory with only config.json is enough."""
    from functional_npu import load_checkpoint

    (tmp_path / "config.json").write_text(json.dumps(DENSE.to_hf()))
    with pytest.raises(ValueError, match=r"made for MixtralForCausalLM, but this model is a Qwen3ForCausalLM"):
        load_checkpoint(tmp_path, Mesh.abstract({"tp": 1}, 0), Plan(model="MixtralForCausalLM"))


def test_model_configs_hold_no_plan_field():
    """What the checkpoint says stays in the config; every parallel choice is the plan's."""
    plan_fields = {f.name for f in dataclasses.fields(Plan)}
    for cfg in (DENSE, MOE, MLA):
        assert not plan_fields & {f.name for f in dataclasses.fields(cfg)}, type(cfg).__name__


@pytest.mark.parametrize("cfg", [DENSE, MOE, MLA], ids=lambda c: c.architecture)
def test_the_table_counts_every_rank_s_bytes(cfg):
    """Each row's bytes are the largest rank's share of that leaf; the total is the largest rank's sum,
    counted independently here from the shards ``shard`` cuts at every coordinate."""
    mesh = Mesh.abstract({"dp": 2, "tp": 2})
    plan = Plan(layer_shard="o_proj", prefetch_step=1, expert_axes=("dp", "tp") if cfg is not DENSE else ())
    text = plan_table(cfg, mesh, plan)
    family = family_of(cfg)
    full = family.init_params(cfg) if cfg is not MOE else moe.init_params(cfg)
    from functional_npu.parallel.layer_shard import series_specs, stack_series

    specs = series_specs(family.param_specs(cfg, plan), plan.layer_shard, cfg.num_layers)
    most = max(
        sum(
            x.numel() * x.element_size()
            for x in torch.utils._pytree.tree_leaves(
                shard(stack_series(full, plan.layer_shard), specs, mesh, coordinate=r)
            )
        )
        for r in range(mesh.size)
    )
    assert text.splitlines()[-1] == f"total bytes per rank: {most:,} (most)"
    assert "series.o_proj" in text and "cyclic(dp, " in text
    if cfg is MOE:  # a leaf only some layers hold is shown with the layers that hold it
        assert "\nlayers.1,3.experts_gate_up " in text and "\nlayers.0,2.gate_up " in text
        assert "layers.*.gate_up" not in text and "\nlayers.*.qkv " in text


def test_compile_refuses_a_plan_that_changes_a_layout_but_takes_one_that_does_not():
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = shard(llama.init_params(DENSE), llama.param_specs(DENSE), mesh, placement=place(DENSE, mesh))
    with pytest.raises(ValueError, match=r"loaded for another plan \(tp='tp', given tp='x'\)"):
        compile_model(params, mesh, plan=Plan(tp="x"), backend="none")
    model = compile_model(params, mesh, plan=Plan(prefetch_budget=1e6), backend="none")
    assert model.plan.prefetch_budget == 1e6 and model.params.placement is model.placement
    assert math.isfinite(float(model.generate([[1, 2, 3]], 2)[0][0]))
