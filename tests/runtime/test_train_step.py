"""The compiled train step against transformers trained by ``torch.optim.AdamW`` after ``clip_grad_norm_``.

Two steps of each, float64, the same batches (each data-parallel rank its own; transformers all of them at once):
the losses, the global gradient norms before clipping, and every updated param (the trained model saved with
``save_pretrained`` and read for each rank by ``load_checkpoint`` with the same plan) agree. Plans: tp 2 (eager,
and compiled with inductor: forward, backward and update in one graph), experts over dp 2 and layer sharding over
dp 2 (eager). Then the bad inputs, each one line naming the leaf or the value, in one process.
"""

import math

import pytest
import torch

from functional_npu import Mesh, load_checkpoint
from functional_npu.runtime.training.grad import lm_loss, value_and_grad
from functional_npu.runtime.training.optim import AdamW
from functional_npu.runtime.training.train_step import compile_train_step

from ..support.hf_models import save_tiny, save_tiny_moe
from ..support.train_workers import hf_train, train_errors

STEPS = 2
# losses and norms, float64 on both sides (transformers' norms and loss in float64 too): dense ~2e-15 (seen); the
# MoE's router softmax is float32 in transformers' own code: ~4e-9 in the loss, ~3e-6 in the second step's norm
TOL = 1e-12
ROUTER_TOL = 1e-5
# updated params: Adam divides each gradient by its own root mean square, so the router's float32 differences of
# near-zero gradient entries grow over two steps at lr 1e-2 (dense: ~1e-13 seen); a wrong clip, decay or bias
# correction moves params by ~lr (test_a_wrong_optimizer_fails_the_check)
PARAM_TOL = 1e-10
ROUTER_PARAM_TOL = 2e-5
# compiled: inductor's vectorized cos and sin of the float32 rope tables (the same float32 tables as eager and as
# transformers') differ from eager's in the last bits, ~3e-10 in the loss (seen)
COMPILED_TOL, COMPILED_PARAM_TOL = 1e-8, 1e-5  # params: ~1.5e-6 seen, after Adam


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{name: (model dir, trained dir, batches, [(loss, norm)] per step)}: transformers' reference runs."""
    out = {}
    g = torch.Generator().manual_seed(5)
    makers = {
        "qwen3": lambda d: save_tiny("qwen3", d, 700),
        "qwen3_moe": lambda d: save_tiny_moe("qwen3_moe", d, 701),
        "qwen3-4l": lambda d: save_tiny("qwen3", d, 702, num_hidden_layers=4),
    }
    for name, make in makers.items():
        model_dir, trained_dir = tmp_path_factory.mktemp(name), tmp_path_factory.mktemp(f"{name}-trained")
        batches = [torch.randint(0, 128, (2, 10), generator=g) for _ in range(2)]
        out[name] = (str(model_dir), str(trained_dir), batches, hf_train(make(model_dir), batches, STEPS, trained_dir))
    return out


def _check(results, ref, *, compiled=False):
    router = any("router" in p for p in results[0]["errors"])
    tol, param_tol = (ROUTER_TOL, ROUTER_PARAM_TOL) if router else (TOL, PARAM_TOL)
    tol, param_tol = (max(tol, COMPILED_TOL), max(param_tol, COMPILED_PARAM_TOL)) if compiled else (tol, param_tol)
    for rank, r in enumerate(results):
        assert r["step"] == STEPS
        for i, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(r["stats"], ref[3])):
            assert abs(loss - want_loss) < tol, f"rank {rank} step {i}: loss {loss} vs {want_loss}"
            assert abs(norm - want_norm) < tol, f"rank {rank} step {i}: grad norm {norm} vs {want_norm}"
        assert ref[3][0][1] > 1.0, "the reference must clip (its norm exceeds max_grad_norm)"
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] < param_tol, f"rank {rank}: params[{worst!r}] off by {r['errors'][worst]}"


@pytest.mark.parametrize("backend", ["none", "inductor"], ids=["eager", "compiled"])
def test_train_step_tp2_matches_torch_adamw(world2, trained, backend):
    model_dir, trained_dir, batches, ref = trained["qwen3"]
    results = world2.run(train_errors, model_dir, trained_dir, {"tp": 2}, {}, [torch.cat(batches)], STEPS, backend)
    _check(results, trained["qwen3"], compiled=backend != "none")


def test_train_step_ep2_matches_torch_adamw(world2, trained):
    model_dir, trained_dir, batches, _ = trained["qwen3_moe"]
    fields = {"expert_axes": ("dp",)}
    results = world2.run(train_errors, model_dir, trained_dir, {"dp": 2, "tp": 1}, fields, batches, STEPS, "none")
    _check(results, trained["qwen3_moe"])


def test_train_step_layer_sharded_matches_torch_adamw(world2, trained):
    model_dir, trained_dir, batches, _ = trained["qwen3-4l"]
    fields = {"layer_shard": "o_proj,down_proj", "prefetch_step": 1}
    results = world2.run(train_errors, model_dir, trained_dir, {"dp": 2, "tp": 1}, fields, batches, STEPS, "none")
    _check(results, trained["qwen3-4l"])


@pytest.mark.parametrize("change", [{"max_grad_norm": None}, {"weight_decay": 0.0}, {"betas": (0.8, 0.95)}])
def test_a_wrong_optimizer_fails_the_check(trained, change):
    """The check can fail: one process (tp 1), each hyperparameter changed in turn, some param moves past PARAM_TOL."""
    model_dir, trained_dir, batches, _ = trained["qwen3"]
    r = train_errors(None, model_dir, trained_dir, {"tp": 1}, {}, [torch.cat(batches)], STEPS, "none", **change)
    assert max(r["errors"].values()) > 5 * PARAM_TOL


# ---- bad input: one line each, naming the leaf or the value -----------------------------------------------


@pytest.fixture(scope="module")
def one(trained):
    mesh = Mesh.abstract({"tp": 1}, 0)
    return load_checkpoint(trained["qwen3"][0], mesh, dtype=torch.float64), mesh, trained["qwen3"][2][0]


@pytest.mark.parametrize("field", ["lr", "eps", "weight_decay", "max_grad_norm"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_non_finite_or_negative_hyperparameters_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"AdamW: {field} must be a finite number .*got {value}"):
        AdamW(**{field: value})


def test_a_beta_of_one_is_refused():
    with pytest.raises(ValueError, match=r"AdamW: betas must be a finite number in \(0.0, 1.0\), got 1.0"):
        AdamW(betas=(0.9, 1.0))


def test_a_non_scalar_loss_is_named_with_its_shape(one):
    params, mesh, batch = one
    per_token = lambda p, b, m: -lm_loss(p, b, m).expand(3)  # noqa: E731
    with pytest.raises(ValueError, match=r"must return a scalar .*shape \(3,\); reduce it"):
        value_and_grad(per_token)(params, batch, mesh)
    for backend in ("none", "aot_eager"):  # traced, the loss's own error: not dynamo's
        step = compile_train_step(per_token, AdamW(), params, mesh, backend=backend)
        with pytest.raises(ValueError, match=r"must return a scalar .*shape \(3,\)"):
            step(params, step.init(params), batch)


def test_params_of_another_plan_are_named_by_leaf(trained, one):
    params, mesh, batch = one
    tp2 = load_checkpoint(trained["qwen3"][0], Mesh.abstract({"tp": 2}, 1), dtype=torch.float64)
    tp2 = tp2 | {k: v.requires_grad_() for k, v in tp2.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=r"compile_train_step: the params were placed for mesh \{'tp': 2\}"):
        compile_train_step(lm_loss, AdamW(), tp2, mesh, backend="none")
    step = compile_train_step(lm_loss, AdamW(), params, mesh, backend="none")
    with pytest.raises(ValueError, match=r"train step: params\['embed'\] is \(64, 64\) torch.float64, but the step"):
        step(tp2, step.init(params), batch)


def test_a_gradient_tree_of_another_structure_is_named(one):
    params, mesh, batch = one
    _, grads = value_and_grad(lm_loss)(params, batch, mesh)
    opt = AdamW()
    state = opt.init(params)
    grads["layers"][1].pop("qkv")
    with pytest.raises(ValueError, match=r"grads has no gradient for params\['layers.1.qkv'\]"):
        opt.update(params, grads, state, torch.tensor(1.0))
    grads["layers"][1]["qkv"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"grads\['layers.1.qkv'\] has shape \(3, 3\) but params"):
        opt.update(params, grads, state, torch.tensor(1.0))


def test_a_nan_loss_stops_the_step_and_keeps_params_and_state(one):
    params, mesh, batch = one
    step = compile_train_step(lambda p, b, m: lm_loss(p, b, m) * math.nan, AdamW(), params, mesh, backend="none")
    state = step.init(params)
    before = params["layers"][0]["qkv"].clone()
    with pytest.raises(FloatingPointError, match=r"train step 1: the loss is nan; the params and optimizer state"):
        step(params, state, batch)
    assert params["layers"][0]["qkv"].equal(before) and int(state.step) == 0 and not state.mu["embed"].any()


def test_a_nan_gradient_is_named_by_leaf_and_not_applied(one):
    params, mesh, batch = one

    def loss(p, b, m):  # finite, but d sqrt(0 * w) / dw = 0 * inf: a NaN gradient for the final norm
        return lm_loss(p, b, m) + (p["norm"] * 0).sqrt().sum()

    step = compile_train_step(loss, AdamW(), params, mesh, backend="none")
    state = step.init(params)
    with pytest.raises(FloatingPointError, match=r"train step 1: the gradient of params\['norm'\] is not finite"):
        step(params, state, batch)
    assert int(state.step) == 0
