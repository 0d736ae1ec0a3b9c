"""Rollouts with log-probabilities, and new weights in a compiled model.

``CompiledModel.sample`` returns each sampled token's log-probability from the decode path's logits; they must
equal ``log_softmax`` of transformers' own logits for the same sequences (the reference nobody here wrote), and
the training forward's (:func:`token_logprobs`, no cache) to float rounding: the gap is measured in float32 and
float64 (decode attends one query over the cache, the training forward the whole sequence at once, so sums run in
another order; float64 shows that only rounding is left). ``with_params`` swaps other weights into the compiled
graphs without a recompile and generates what a fresh model of those weights generates."""

import pytest
import torch

from functional_npu import Mesh, Plan, compile_model, load_checkpoint
from functional_npu.runtime.training.grad import token_logprobs
from functional_npu.runtime.training.policy import logprob_gap, policy_batch

from ..support.hf_models import save_tiny

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3, 4]]
NEW = 6


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two tiny Qwen3 checkpoints (other seeds) and transformers' model of the first."""
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    return str(a), str(b), save_tiny("qwen3", a, 21), save_tiny("qwen3", b, 22)


def _model(path, dtype, backend="none"):
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = load_checkpoint(path, mesh, dtype=dtype)
    return compile_model(params, mesh, backend=backend, batch_sizes=[3], max_seq_len=16, prefill_lengths=[4]), mesh


def test_rollout_logprobs_equal_transformers(two):
    path, _, hf, _ = two
    model, _ = _model(path, torch.float32)
    s = model.sample(PROMPTS, NEW, temperature=0.8, seed=3)
    seq = torch.tensor([p + t for p, t in zip(PROMPTS, s.tokens)])
    with torch.no_grad():
        ref = torch.log_softmax(hf(seq).logits[:, 3:-1].float() / 0.8, -1)
    want = ref.gather(-1, seq[:, 4:, None])[..., 0]
    assert (torch.tensor(s.logprobs) - want).abs().max().item() < 2e-5
    assert s.tokens == model.sample(PROMPTS, NEW, temperature=0.8, seed=3).tokens  # seeded


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
def test_rollout_and_training_forward_agree_to_rounding(two, dtype, bound):
    model, mesh = _model(two[0], dtype)
    s = model.sample(PROMPTS, NEW, seed=4)
    batch = policy_batch(PROMPTS, s, [0.0] * len(PROMPTS), dtype=dtype)
    gap = logprob_gap(token_logprobs(model.params, batch.tokens, mesh), batch)
    assert gap < bound


def test_with_params_swaps_weights_without_recompiling(two):
    from torch._dynamo.utils import counters

    a, b, _, _ = two
    model, mesh = _model(a, torch.float32, backend="aot_eager")
    before = model.generate(PROMPTS, NEW)
    graphs = counters["stats"]["unique_graphs"]
    other = load_checkpoint(b, mesh)
    swapped = model.with_params(other)
    got = swapped.generate(PROMPTS, NEW)
    assert counters["stats"]["unique_graphs"] == graphs, "with_params must reuse the compiled graphs"
    assert got == _model(b, torch.float32)[0].generate(PROMPTS, NEW) and got != before
    assert model.generate(PROMPTS, NEW) == before  # the original model still has its weights


def test_with_params_refuses_params_of_another_plan(two):
    model, _ = _model(two[0], torch.float32)
    tp2 = load_checkpoint(two[0], Mesh.abstract({"tp": 2}, 0))
    with pytest.raises(ValueError, match=r"with_params: the params were placed for mesh \{'tp': 2\} .* the mesh is"):
        model.with_params(tp2)
    with pytest.raises(
        ValueError, match=r"with_params: the params were loaded for another plan \(tp=.dp., given tp=.tp.\)"
    ):
        model.with_params(load_checkpoint(two[0], Mesh.abstract({"dp": 1, "tp": 1}, 0), Plan(tp="dp")))


def test_with_params_refuses_an_integer_leaf_in_a_float_one_place(two):
    """An int64 embedding or norm once ran, generating tokens from truncated weights."""
    from functional_npu.core.params import Params

    model, mesh = _model(two[0], torch.float32)
    params = load_checkpoint(two[0], mesh)
    layers = [dict(layer) for layer in params["layers"]]
    layers[0]["q_norm"] = layers[0]["q_norm"].to(torch.int64)
    for tree, path in (
        (dict(params.tree) | {"embed": params["embed"].to(torch.int64)}, "embed"),
        (dict(params.tree) | {"layers": layers}, "layers.0.q_norm"),
    ):
        with pytest.raises(ValueError, match=rf"^with_params: params\['{path}'\] is torch.int64 on cpu, the compiled "):
            model.with_params(Params(tree, placement=params.placement))
