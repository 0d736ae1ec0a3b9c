"""The Placement: made once per model, mesh, plan and quantization, carried from load to compile, and the one rule
every consumer reads a plan by; a placement of another model, mesh or quantization refused by name."""

import dataclasses
import sys

import pytest
import torch

from functional_npu import (
    AdamW,
    Mesh,
    Params,
    Plan,
    compile_model,
    compile_train_step,
    lm_loss,
    load_checkpoint,
    place,
    save_checkpoint,
    shard,
)
from functional_npu.models import llama
from functional_npu.placement import Placement, builds, placement_of

from ..support.configs import DENSE

CFG = dataclasses.replace(DENSE, num_layers=3)
LAYERED = Plan(layer_shard="o_proj,down_proj", prefetch_step=1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(llama.init_params(CFG, seed=3), tmp_path_factory.mktemp("dense"))


class _Calls:
    """Counts the calls of some functions (by their code objects) while active, with sys.setprofile."""

    def __init__(self, *fns):
        self.codes = {fn.__code__: fn.__name__ for fn in fns}
        self.count = dict.fromkeys(self.codes.values(), 0)

    def __enter__(self):
        def profile(frame, event, _arg):
            if event == "call" and frame.f_code in self.codes:
                self.count[self.codes[frame.f_code]] += 1

        self._old = sys.getprofile()
        sys.setprofile(profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._old)


def test_load_and_compile_build_one_placement_and_the_family_trees_once(ckpt):
    mesh = Mesh.abstract({"dp": 2, "tp": 1}, 1)
    before = builds()
    with _Calls(llama.abstract_params, llama.param_specs) as calls:
        params = load_checkpoint(ckpt, mesh, dataclasses.replace(LAYERED, prefetch_step=2))  # a plan never placed
        model = compile_model(params, mesh, backend="none")
        model.with_params(params)
    assert builds() - before == 1  # the loader's, carried to compile and with_params (k's change builds none)
    assert calls.count == {"abstract_params": 1, "param_specs": 1}
    assert model.placement.plan.prefetch_step == 2 and model.placement.layouts is params.placement.layouts


def test_the_counter_sees_a_build():
    """The checks above can fail: a placement never made before is a build, and it calls each family function."""
    before = builds()
    with _Calls(llama.abstract_params, llama.param_specs) as calls:
        place(dataclasses.replace(CFG, num_layers=5), {"tp": 2})
    assert builds() - before == 1 and calls.count == {"abstract_params": 1, "param_specs": 1}


def test_a_placement_answers_what_was_rederived(ckpt):
    mesh = Mesh.abstract({"dp": 2, "tp": 2})
    placed = place(CFG, mesh, LAYERED)
    assert place(CFG, mesh, LAYERED) is placed and placed.plan.layer_shard.leaves == ("o_proj", "down")
    assert placed.mesh_shape == {"dp": 2, "tp": 2} and placed.axis_groups() == []
    assert placed.local_shape("series.o_proj", mesh.at(0)) == (2, CFG.hidden_size, CFG.num_heads * CFG.head_dim // 2)
    held = placed.held_bytes(mesh)  # rank 0 owns layers 0 and 2 of the series, rank 2 (dp 1) layer 1
    assert held[0] > held[2] and len(held) == 4
    assert "series.o_proj" in placed.table() and '"axes": {' in placed.to_json()


def test_a_plan_beside_placed_params_changes_only_what_decides_no_layout(ckpt):
    mesh = Mesh.abstract({"dp": 2, "tp": 1}, 0)
    params = load_checkpoint(ckpt, mesh, LAYERED)
    placed = params.placement
    assert placed.with_plan(dataclasses.replace(LAYERED, prefetch_step=0), "x").plan.prefetch_step == 0
    with pytest.raises(ValueError, match=r"^x: the params were loaded for another plan \(layer_shard=.*, given "):
        placed.with_plan(Plan(), "x")
    with pytest.raises(TypeError, match=r"^x: plan must be a functional_npu.Plan, got dict"):
        placed.with_plan({"tp": "tp"}, "x")


def _other_model() -> dict:
    return dataclasses.replace(CFG, rope_theta=CFG.rope_theta * 2, rms_norm_eps=1e-5)


def test_a_placement_for_another_model_mesh_or_quantization_is_refused_by_name(ckpt):
    mesh = Mesh.abstract({"tp": 2}, 0)
    params = load_checkpoint(ckpt, mesh)
    # the config is held once, the placement's: params of one config cannot carry another's placement
    with pytest.raises(ValueError, match=r"^Params: the placement was made for 'Qwen3ForCausalLM', not for the config"):
        Params(params.tree, params.config, place(_other_model(), mesh))
    other = Params(params.tree, placement=place(_other_model(), mesh))  # these tensors, said to be the other model's
    assert other.config is other.placement.config and other.config != params.config
    wider = params.placed(place(params.config, {"tp": 4}))
    with pytest.raises(ValueError, match=r"^compile_model: the params were placed for mesh \{'tp': 4\} .* the mesh"):
        compile_model(wider, mesh, backend="none")
    with pytest.raises(ValueError, match=r": the placement was made for another model \(Qwen3ForCausalLM on"):
        load_checkpoint(ckpt, mesh, place(_other_model(), mesh))
    with pytest.raises(TypeError, match=r"^Params: placement must be a functional_npu.Placement .*, got Plan"):
        params.placed(Plan())
    with pytest.raises(KeyError, match=r"params\['placement'\]: the placement is a field of the params, not a key"):
        params["placement"]
    with pytest.raises(TypeError, match=r"^Params: \['config'\] in the tree; the config and the placement are fields"):
        params | {"config": params.config}


def test_params_that_disagree_with_their_placement_are_refused_naming_the_leaf(ckpt):
    mesh = Mesh.abstract({"tp": 2}, 0)
    params = load_checkpoint(ckpt, mesh)
    bad = params | {"norm": torch.ones(CFG.hidden_size + 1)}
    with pytest.raises(ValueError, match=r"^compile_model: params\['norm'\] has shape \(65,\) but mesh .* expects"):
        compile_model(bad, mesh, backend="none")
    missing = params.without("norm")
    with pytest.raises(ValueError, match=r"^compile_train_step: params\['norm'\] is missing"):
        compile_train_step(lm_loss, AdamW(), missing, mesh, backend="none")


def test_swapping_another_models_weights_into_a_compiled_model_names_the_fields(ckpt, tmp_path):
    """Same shapes, other constants: the graphs baked in this model's rope base and norm epsilon."""
    mesh = Mesh.abstract({"tp": 1}, 0)
    model = compile_model(load_checkpoint(ckpt, mesh), mesh, backend="none")
    other = load_checkpoint(save_checkpoint(llama.init_params(_other_model(), seed=3), tmp_path / "o"), mesh)
    with pytest.raises(ValueError, match=r"^with_params: the params are not of the compiled model: rms_norm_eps=1e-05"):
        model.with_params(other)
    assert isinstance(model.with_params(load_checkpoint(ckpt, mesh)).placement, Placement)
    bf16 = load_checkpoint(ckpt, mesh, dtype=torch.bfloat16)  # once a raw matmul error at the first step
    with pytest.raises(ValueError, match=r"^with_params: params\['embed'\] is torch.bfloat16 on cpu, the compiled"):
        model.with_params(bf16)


def test_params_with_no_placement_are_placed_by_the_plan_given(ckpt):
    mesh = Mesh.abstract({"tp": 2}, 1)
    params = shard(llama.init_params(CFG), llama.param_specs(CFG), mesh)
    assert placement_of(params, mesh, where="x") is place(CFG, mesh)
    with pytest.raises(ValueError, match=r"^x: params\['embed'\] has shape .* but mesh \{'tp': 1\}"):
        placement_of(params, Mesh.abstract({"tp": 1}, 0), where="x")  # sharded for another mesh: the shapes say so
