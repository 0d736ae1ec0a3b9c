"""MoE families in one process: routing against transformers' routers, config round trip, dense layers mixed in
(Qwen3-MoE mlp_only_layers), the loader reading only local experts, save_checkpoint, and every bad input."""

import json

import pytest
import torch
import transformers as T

from functional_npu import Mesh, Plan, check_plan, compile_model, local_shape, place
from functional_npu.core.shard import leaf_specs, shard
from functional_npu.core.tree import flatten_with_paths
from functional_npu.models import family_of, forward, init_state, moe
from functional_npu.models.experts import local_experts, route
from functional_npu.runtime.loading.checkpoint import load_checkpoint, read_config
from functional_npu.runtime.loading.save import save_checkpoint

from ..support.hf_models import MOE_COMMON, MOE_FAMILIES, save_tiny_moe
from ..support.workers import redundant_placement


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for i, name in enumerate(MOE_FAMILIES):
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, save_tiny_moe(name, path, 300 + i))
    return out


def _hf_dict(model) -> dict:
    return model.config.to_dict() | {"architectures": [type(model).__name__]}


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_route_matches_transformers_router(family, norm):
    cls, cfg_cls, extra = MOE_FAMILIES[family]
    hf_cfg = cfg_cls(**MOE_COMMON, **(extra | {"norm_topk_prob": norm} if family != "mixtral" else extra))
    torch.manual_seed(0)
    model = cls(hf_cfg).eval()
    router = model.model.layers[-1].mlp.gate  # the last layer is an MoE layer in every family here
    cfg = moe.MoeConfig.from_hf(_hf_dict(model))
    assert cfg.norm_topk_prob == (norm or family == "mixtral")
    x = torch.randn(40, 64)
    with torch.no_grad():
        _, hf_weights, hf_experts = router(x)
        weights, experts = route(x @ router.weight.T, cfg)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_config_round_trip(saved, family):
    cfg = read_config(saved[family][0])
    assert moe.MoeConfig.from_hf(cfg.to_hf()) == cfg
    layers = (1,) if family == "qwen2_moe" else (0, 1)  # Qwen2-MoE's first layer is dense (mlp_only_layers)
    assert family_of(cfg).name == "moe" and cfg.moe_layers == layers and cfg.num_experts == 8 and cfg.top_k == 2


def test_dense_layers_mixed_in_match_transformers(tmp_path):
    """Qwen3-MoE with mlp_only_layers=[1] and norm_topk_prob=False: layer 1 is a dense MLP."""
    cls, cfg_cls, extra = MOE_FAMILIES["qwen3_moe"]
    torch.manual_seed(5)
    model = cls(cfg_cls(**MOE_COMMON, **(extra | {"mlp_only_layers": [1], "norm_topk_prob": False}))).eval()
    model.save_pretrained(tmp_path)
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = load_checkpoint(tmp_path, mesh)
    assert params.config.moe_layers == (0,) and "gate_up" in params["layers"][1] and "router" in params["layers"][0]
    ids = torch.tensor([[5, 9, 100, 3, 77, 12, 1]])
    with torch.no_grad():
        ref = model(ids).logits
        got = forward(params, ids, torch.arange(7)[None], init_state(params.config, mesh, 1, 8), mesh)
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "axes,expert_axes", [({"dp": 2, "tp": 2}, ("dp", "tp")), ({"dp": 2, "tp": 2}, ("dp",)), ({"tp": 4}, ())]
)
def test_each_rank_reads_exactly_its_experts(saved, axes, expert_axes):
    path, plan = saved["mixtral"][0], Plan(expert_axes=expert_axes)
    cfg = read_config(path)
    full = dict(flatten_with_paths(moe.abstract_params(cfg, plan)))
    layouts = leaf_specs(moe.param_specs(cfg, plan), moe.abstract_params(cfg, plan))
    whole = load_checkpoint(path, Mesh.abstract({"tp": 1}, 0))
    for rank in range(4):
        mesh = Mesh.abstract(axes, rank)
        read: list[int] = []
        params = load_checkpoint(path, mesh, plan, on_read=lambda name, n: read.append(n))
        local = 0
        for p, x in flatten_with_paths(params):
            assert tuple(x.shape) == local_shape(full[p].shape, layouts[p], mesh), p
            local += 0 if p.endswith("expert_map") else x.numel() * x.element_size()  # computed, not read
        assert sum(read) == local
        want = shard(whole, moe.param_specs(cfg, plan), mesh)  # the same slices cut from the whole model
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(flatten_with_paths(params), flatten_with_paths(want)))


def test_save_checkpoint_round_trip(saved, tmp_path):
    path, model = saved["qwen3_moe"]
    params = load_checkpoint(path, Mesh.abstract({"tp": 1}, 0))
    save_checkpoint(params, tmp_path)
    again = T.Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_save_refuses_a_redundant_placement(saved, tmp_path):
    params, _ = redundant_placement(
        load_checkpoint(saved["mixtral"][0], Mesh.abstract({"tp": 1}, 0)), [0], list(range(8))
    )
    with pytest.raises(
        ValueError,
        match=r"save_checkpoint: params\['layers.0.expert_map'\] holds an expert placement other than the identity "
        r"\(shape \(8, 2\)\).*identity placement",
    ):
        save_checkpoint(params, tmp_path)


def test_config_and_expert_weights_disagree(saved, tmp_path):
    import shutil

    path = shutil.copytree(saved["qwen3_moe"][0], tmp_path / "model")
    hf = json.loads((path / "config.json").read_text()) | {"moe_intermediate_size": 16}
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(
        ValueError,
        match=r"tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' "
        r"\(for params\['layers.0.experts_gate_up'\]\) has shape "
        r"\(32, 64\) but config.json implies \(16, 64\) .*num_experts=8, moe_intermediate_size=16\)",
    ):
        load_checkpoint(path, Mesh.abstract({"tp": 1}, 0))


def test_expert_axes_on_a_dense_model(tmp_path):
    T.Qwen3ForCausalLM(T.Qwen3Config(**MOE_COMMON, intermediate_size=96, head_dim=16)).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"plan.expert_axes=\('tp',\) needs a mixture-of-experts model, but this is a Qwen3ForCausalLM; drop it",
    ):
        load_checkpoint(tmp_path, Mesh.abstract({"tp": 2}, 0), Plan(expert_axes=("tp",)))


def test_expert_count_not_divisible(saved):
    with pytest.raises(
        ValueError,
        match=r"cannot shard this MixtralForCausalLM config: "
        r"specs\['layers.0.experts_gate_up'\] shards dim 0 \(size 8\) "
        r"over mesh axis 'dp' \(size 3\): 3 does not divide 8",
    ):
        load_checkpoint(saved["mixtral"][0], Mesh.abstract({"dp": 3, "tp": 1}, 0), Plan(expert_axes=("dp",)))


def test_unknown_expert_axis(saved):
    with pytest.raises(
        ValueError,
        match=r"plan.expert_axes names axis 'ep', but the mesh \{'tp': 2\} has no such axis; use some of \['tp'\]",
    ):
        load_checkpoint(saved["mixtral"][0], Mesh.abstract({"tp": 2}, 0), Plan(expert_axes=("ep",)))


def test_expert_axes_out_of_mesh_order(saved):
    with pytest.raises(
        ValueError, match=r"shards over axes \('tp', 'dp'\), which must be in mesh order: write \('dp', 'tp'\)"
    ):
        load_checkpoint(saved["mixtral"][0], Mesh.abstract({"dp": 2, "tp": 2}, 0), Plan(expert_axes=("tp", "dp")))


def test_compile_model_refuses_params_of_another_expert_plan(saved):
    full = load_checkpoint(saved["mixtral"][0], Mesh.abstract({"tp": 1}, 0))
    mesh = Mesh.abstract({"dp": 2, "tp": 1}, 0)
    # experts replicated, the plan says so
    params = shard(full, moe.param_specs(full.config), mesh, placement=place(full.config, mesh))
    over_dp = Plan(expert_axes=("dp",))
    with pytest.raises(ValueError, match=r"the params were loaded for another plan \(expert_axes=\(\)"):
        compile_model(params, mesh, backend="eager", plan=over_dp)
    params = params.placed(None)  # ... and params that carry no placement, compiled for ep over dp
    with pytest.raises(
        ValueError,
        match=r"params\['layers.0.experts_gate_up'\] has shape \(8, 96, 64\) "
        r"but mesh \{'dp': 2, 'tp': 1\} at \{'dp': 0, 'tp': 0\} expects \(4, 96, 64\)",
    ):
        compile_model(params, mesh, backend="eager", plan=over_dp)


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"num_experts_per_tok": 9},
            r"config.json: fields 'num_experts_per_tok', 'num_local_experts': 9 experts per token is more than the "
            r"model's 8 experts; lower num_experts_per_tok",
        ),
        (
            {"num_local_experts": None, "num_experts": None},
            r"config.json: field 'num_experts' is null \(the number of routed experts\); give an int",
        ),
        (
            {"shared_expert_intermediate_size": 64},
            r"shared_expert_intermediate_size 64 is not supported; supported: 0 \(the shared expert's MLP width "
            r"\(Qwen2-MoE\)\)",
        ),
        ({"architectures": ["DbrxForCausalLM"]}, r"unsupported architecture 'DbrxForCausalLM'"),
    ],
)
def test_bad_configs(saved, change, message):
    hf = json.loads((saved["qwen3_moe"][0] / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=message):
        moe.MoeConfig.from_hf(hf)


def test_a_plan_rejects_unknown_fields_and_bad_values():
    with pytest.raises(ValueError, match=r"plan: unknown plan fields \['ep'\]; the fields are \['tp', "):
        Plan.from_dict({"ep": 2})
    with pytest.raises(
        ValueError, match=r"Plan.num_slots must be an int in \[1, 2147483648\] \(or None: one per expert\), got 0"
    ):
        Plan(num_slots=0)


def test_init_params_is_the_identity_placement(saved):
    cfg = read_config(saved["mixtral"][0])
    params = moe.init_params(cfg)
    assert torch.equal(params["layers"][0]["expert_map"], torch.arange(8)[:, None])
    with pytest.raises(ValueError, match=r"plan.num_slots=7 is fewer than the model's 8 experts"):
        check_plan(cfg, Mesh.abstract({"tp": 1}), Plan(num_slots=7))


@pytest.mark.parametrize("rows", [1, 3, 40], ids=["decode", "decode-3", "prefill"])
def test_local_experts_match_a_per_row_loop(rows):
    """Both shapes of the expert computation (read the chosen experts / run every local expert) against a plain loop."""
    g = torch.Generator().manual_seed(rows)
    s, d, f, k = 8, 16, 12, 2
    gate_up, down = torch.randn(s, 2 * f, d, generator=g), torch.randn(s, d, f, generator=g)
    x, weights = torch.randn(rows, d, generator=g), torch.rand(rows, k, generator=g)
    ids = torch.randint(-1, s, (rows, k), generator=g)
    want = torch.zeros(rows, d)
    for n in range(rows):
        for j in range(k):
            if ids[n, j] >= 0:
                gate, up = (gate_up[ids[n, j]] @ x[n]).chunk(2)
                want[n] += weights[n, j] * (down[ids[n, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(local_experts(x, ids, weights, gate_up, down), want, rtol=1e-5, atol=1e-5)
