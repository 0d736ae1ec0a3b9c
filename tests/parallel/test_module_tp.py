"""The module-TP plan as data: dp split into nested chunk axes, and plans a mesh or config cannot serve refused."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from functional_npu import Mesh, ModuleTP, Plan, split_dp
from functional_npu.models import LlamaConfig, dense, llama, moe
from functional_npu.placement import check_plan

CFG = LlamaConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    qk_norm=True,
)


@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]), st.data())
def test_each_module_group_is_a_chunk_of_consecutive_dp_ranks_at_one_tp_index(dp, tp, data):
    """A size-n module group is every n consecutive dp indices at one tp index (seed 003's groups)."""
    divisors = [n for n in (1, 2, 4, 8) if dp % n == 0]
    sizes = {m: data.draw(st.sampled_from(divisors), label=m) for m in ("o_proj", "lm_head", "embed", "mlp")}
    axes, plan = split_dp({"dp": dp, "tp": tp}, sizes)
    mesh = Mesh.abstract(axes)
    assert mesh.size == dp * tp and list(axes)[-1] == "tp"
    for module, n in sizes.items():
        groups = mesh.all_group_ranks(getattr(plan, module)) if n > 1 else [(r,) for r in range(dp * tp)]
        want = [tuple((c * n + i) * tp + t for i in range(n)) for c in range(dp // n) for t in range(tp)]
        assert sorted(groups) == sorted(want), (module, n)


def test_split_names_nested_axes():
    axes, plan = split_dp({"dp": 8, "tp": 2}, {"o_proj": 2, "lm_head": 4, "mlp": 1})
    assert axes == {"dp": 2, "dp4": 2, "dp2": 2, "tp": 2}
    assert plan == ModuleTP(o_proj=("dp2",), lm_head=("dp4", "dp2"))
    assert split_dp({"dp": 2, "tp": 1}, {}) == ({"dp": 2, "tp": 1}, ModuleTP())


@pytest.mark.parametrize(
    "sizes, message",
    [
        ({"o_proj": 3}, "o_proj size 3 must divide the 'dp' size 4"),
        ({"lm_head": 8}, "lm_head size 8 exceeds the 'dp' size 4"),
        ({"mlp": 0}, "mlp size must be a positive int"),
        ({"attention": 2}, "unknown modules ['attention']"),
    ],
)
def test_split_refuses_sizes_that_are_not_chunks_of_dp(sizes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        split_dp({"dp": 4, "tp": 1}, sizes)


def test_split_refuses_sizes_that_do_not_nest():
    with pytest.raises(ValueError, match="sizes 2 and 3 .* do not nest"):
        split_dp({"dp": 6, "tp": 1}, {"o_proj": 2, "mlp": 3})


def test_layouts_cut_each_module_over_its_group_and_tp():
    axes, plan = split_dp({"dp": 4, "tp": 2}, {"o_proj": 2, "lm_head": 4, "embed": 4, "mlp": 2})
    specs = llama.param_specs(CFG, Plan(module_tp=plan))
    layer = specs["layers"][0]
    assert layer["o_proj"].dims[1].axes == ("dp2", "tp")
    assert layer["gate_up"].dims[0].axes == ("dp2", "tp") and layer["down"].dims[1].axes == ("dp2", "tp")
    assert specs["lm_head"].dims[0].axes == ("dp4", "dp2", "tp") == specs["embed"].dims[0].axes
    assert layer["qkv"].dims[0].axes == ("tp",)  # attention stays data-parallel (tp inside)
    _, layouts = check_plan(CFG, Mesh.abstract(axes), Plan(module_tp=plan))
    assert layouts["lm_head"].dims[0].axes == ("dp4", "dp2", "tp")


def _refused(cfg, axes, message, **plan):
    with pytest.raises(ValueError, match=message):
        check_plan(cfg, Mesh.abstract(axes), Plan(**plan), where="m")


def test_plans_a_mesh_or_config_cannot_serve_are_refused():
    axes = {"dp": 2, "dp2": 2, "tp": 2}
    _refused(CFG, axes, r"o_proj TP over mesh axes \('otp',\): 'otp' is not", module_tp=ModuleTP(o_proj="otp"))
    _refused(CFG, axes, "the tensor-parallel axis 'tp' is already", module_tp=ModuleTP(mlp=("dp2", "tp")))
    _refused(CFG, axes, "must be distinct and in mesh order", module_tp=ModuleTP(mlp=("dp2", "dp")))
    _refused(CFG, {"dp": 2, "tp": 2, "dp2": 2}, "must precede 'tp'", module_tp=ModuleTP(embed="dp2"))
    tied = dataclasses.replace(CFG, tie_word_embeddings=True)
    _refused(tied, axes, "lm_head TP over .* with tied embeddings", module_tp=ModuleTP(lm_head="dp2"))
    big = dataclasses.replace(CFG, vocab_size=120)  # 120 rows over 2 x 2 x 2 = 8 ranks: 15 each; over 16: no
    check_plan(big, Mesh.abstract(axes), Plan(module_tp=ModuleTP(embed=("dp", "dp2"))))
    _refused(big, {"dp": 4, "dp2": 2, "tp": 2}, r"specs\['embed'\]", module_tp=ModuleTP(embed=("dp", "dp2")))


def test_module_tp_with_experts_over_the_same_ranks_is_refused():
    base = dataclasses.replace(CFG, architecture="Qwen3ForCausalLM")
    cfg = moe.MoeConfig(
        architecture="Qwen3MoeForCausalLM",
        **dense.dense_fields(base),
        num_experts=4,
        top_k=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        moe_layers=(0, 1),
    )
    axes = {"dp": 1, "dp2": 2, "tp": 2}
    o_proj = ModuleTP(o_proj="dp2")
    _refused(cfg, axes, "module TP and expert parallelism over the same", module_tp=o_proj, expert_axes=("dp2", "tp"))
    _refused(cfg, axes, "every layer of this .* is an MoE layer", module_tp=ModuleTP(mlp="dp2"))
    check_plan(cfg, Mesh.abstract(axes), Plan(module_tp=o_proj))  # o_proj TP serves with the experts replicated
