"""The invariant modes (``Plan(invariant="batch")``, the fast kernels at pinned shapes, and ``"portable"``, trees of
adds): a sequence's rollout log-probabilities equal the training forward's bit for bit; every test runs both.

A rollout samples each prompt beside others of other lengths (batches 1, 3 and 8, right-padded to a prefill bucket,
then decode steps over a 16-slot KV cache); the training forward (:func:`token_logprobs`) runs the whole sequences at
once on a cache as long as the batch's widest. With the mode on the largest difference over every completion token
is 0.0, in float32 and bfloat16, on one rank and on two tensor-parallel gloo ranks, eager and compiled with inductor
(the rollout, and the training forward inside a compiled train step). With it off the same comparisons differ
(float32 ~5e-7, bfloat16 ~2e-3): the tests fail without the mode. Then the bad inputs.
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from functional_npu import Mesh, Plan, compile_model, load_checkpoint
from functional_npu.core import flatten_with_paths
from functional_npu.runtime.serving import Backend, resolve_backend
from functional_npu.runtime.serving.compile_policy import invariant_options
from functional_npu.runtime.training.grad import lm_loss, logits, token_logprobs, value_and_grad
from functional_npu.runtime.training.policy import logprob_gap, policy_batch

from ..support.hf_models import save_tiny, save_tiny_gemma3, save_tiny_moe
from ..support.invariant_workers import (
    NEW,
    compiled_step_mismatch,
    gaps_on_rank,
    model_for,
    rollout_gaps,
    training_logprobs,
)

VOCAB = 128
MODES = ["batch", "portable"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-invariant")
    save_tiny("qwen3", path, 31)
    return str(path)


@pytest.fixture(scope="module")
def eager(qwen3):
    """{(dtype, invariant): (model, mesh)} on one rank, the plain Python forward."""
    modes = (*MODES, False)
    return {(d, inv): model_for(None, qwen3, 1, d, inv, "none") for d in ("float32", "bfloat16") for inv in modes}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rollout_logprobs_equal_training_forward_eager(eager, dtype, mode):
    model, mesh = eager[(dtype, mode)]
    sets = [[[7, 3, 9, 4, 11]], [[5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6, 7]]]
    sets.append(sets[1] + [[3], [9, 10], [12] * 6, [2, 4], [8, 8, 1, 30, 5]])  # 8 rows
    assert rollout_gaps(model, mesh, sets) == [0.0, 0.0, 0.0]
    # the control in float32: in bfloat16 the default forward's attention (attention.grouped, two batched
    # matmuls) gives these small inputs the same bits in both forwards, so it shows nothing there
    off, mesh = eager[("float32", False)]
    assert max(rollout_gaps(off, mesh, sets)) > 0.0, "without the mode the two forwards must differ (the control)"


@given(
    prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), min_size=1, max_size=8),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@pytest.mark.parametrize("mode", MODES)
def test_any_batch_composition_gives_the_training_forwards_bits(eager, mode, prompts, seed):
    model, mesh = eager[("float32", mode)]
    assert rollout_gaps(model, mesh, [prompts], seed=seed) == [0.0]


def test_teacher_forced_logits_do_not_depend_on_the_batch(eager):
    """Each sequence alone (its own width) and in a right-padded batch of others: the same logits at its positions."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, VOCAB, (n,), generator=g) for n in (3, 9, 6, 12)]
    batch = torch.zeros(len(rows), 12, dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = r
    differs = []
    for invariant in (*MODES, False):
        model, mesh = eager[("float32", invariant)]
        together = logits(model.params, batch, mesh)
        alone = [logits(model.params, r[None], mesh)[0] for r in rows]
        same = [torch.equal(a, together[i, : len(r)]) for i, (a, r) in enumerate(zip(alone, rows))]
        differs.append(not all(same))
    assert differs == [False, False, True], "invariant: equal; the default forward: some row differs (the control)"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rollout_logprobs_equal_training_forward_tp2(world2, qwen3, dtype, mode):
    on = world2.run(gaps_on_rank, qwen3, 2, dtype, mode)
    assert on == [[0.0, 0.0, 0.0]] * 2
    # the control in float32: in bfloat16 the default forward's attention (attention.grouped, two batched
    # matmuls) gives these small inputs the same bits in both forwards, so it shows nothing there
    off = world2.run(gaps_on_rank, qwen3, 2, "float32", False)
    assert max(max(g) for g in off) > 0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_plan_gives_the_same_bits(world2, qwen3, eager, dtype, mode):
    """tp 2 sums each row-parallel linear's chunks on its rank and the two ranks' sums last, the unsharded tree's
    order; a layer-sharded data-parallel plan computes each layer as tp 1 does: every plan, the same log-probs."""
    model, mesh = eager[(dtype, mode)]
    tokens = torch.tensor([[5, 6, 7, 8, 9, 1, 2], [9, 10, 11, 3, 0, 0, 0]])
    want = token_logprobs(model.params, tokens, mesh)
    tp2 = world2.run(training_logprobs, qwen3, {"tp": 2}, {"invariant": mode}, dtype, tokens)
    shard = {"layer_shard": "layer", "invariant": mode}
    sharded = world2.run(training_logprobs, qwen3, {"dp": 2, "tp": 1}, shard, dtype, tokens)
    assert all(torch.equal(got, want) for got in tp2 + sharded)


@pytest.mark.parametrize("mode", MODES)
def test_its_gradients_are_the_default_forwards(qwen3, mode):
    """The invariant ops' gradients are the ordinary ones (closed forms in float32): the same loss and gradients as the
    default forward to float32 rounding (a wrong rule, such as attention's scale left out, is off by far more)."""
    mesh = Mesh.abstract({"tp": 1}, 0)
    tokens = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    runs = [
        value_and_grad(lm_loss)(load_checkpoint(qwen3, mesh, Plan(invariant=i)), tokens, mesh) for i in (mode, False)
    ]
    (loss, grads), (ref_loss, ref) = runs
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    want = {p: g for p, g in flatten_with_paths(ref) if isinstance(g, torch.Tensor)}
    got = {p: g for p, g in flatten_with_paths(grads) if isinstance(g, torch.Tensor)}
    assert got.keys() == want.keys() and len(got) > 10
    for p, g in want.items():
        assert (got[p] - g).abs().max() <= 1e-5 * g.abs().max(), p


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    """A one-layer Qwen3 for the compiled cases (an invariant graph is many small ops: about a minute to compile a
    layer's train step on two cores)."""
    path = tmp_path_factory.mktemp("qwen3-1l")
    save_tiny("qwen3", path, 32, num_hidden_layers=1)
    return str(path)


@pytest.mark.parametrize("mode", MODES)
def test_compiled_rollout_and_compiled_train_step_agree_bitwise(one_layer, mode):
    """Inductor's rollout against the eager training forward, and the forward inside a compiled train step: the
    step's loss is the largest log-prob difference, 0.0 exactly with the mode (about 5e-7 without)."""
    on = compiled_step_mismatch(None, one_layer, 1, "float32", mode)
    assert on == {"gap": 0.0, "step_loss": 0.0}


@pytest.mark.parametrize("mode", MODES)
def test_compiled_rollout_tp2_bfloat16(world2, one_layer, mode):
    got = world2.run(compiled_step_mismatch, one_layer, 2, "bfloat16", mode, False)
    assert got == [{"gap": 0.0}] * 2


# bad inputs: each refused in one line naming the op


def test_families_without_an_invariant_form_are_refused(tmp_path):
    save_tiny_gemma3("gemma3", tmp_path, 3)
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = load_checkpoint(str(tmp_path), mesh, Plan(invariant=True))
    with pytest.raises(
        ValueError,
        match=r"compile_model: Plan.invariant: Gemma3ForCausalLM has no invariant form "
        r"of the tanh of its GELU and of its logit soft-capping",
    ):
        compile_model(params, mesh, backend="none")
    with pytest.raises(ValueError, match=r"forward: Plan.invariant: Gemma3ForCausalLM has no invariant form"):
        token_logprobs(params, torch.zeros(1, 4, dtype=torch.long), mesh)


def test_backends_dtypes_and_linears_without_it_are_refused(qwen3):
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = load_checkpoint(qwen3, mesh, Plan(invariant=True))
    cuda = resolve_backend("inductor", device_type="cuda")
    refused = r"compile_model: Plan.invariant on backend 'inductor' \(cuda\): its generated kernels are not checked "
    with pytest.raises(ValueError, match=refused + r".* the backends that run it on cuda are \['aot_eager'"):
        invariant_options(params, params.placement, cuda, "compile_model")
    with pytest.raises(ValueError, match=r"linear='streamed' reduces in inductor's order"):
        compile_model(params, mesh, backend="inductor", linear="streamed")
    wide = load_checkpoint(qwen3, mesh, Plan(invariant=True), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"compile_model: the invariant mode computes in float32 .* not torch.float64"):
        compile_model(wide, mesh, backend="none")
    with pytest.raises(ValueError, match=r"Plan.invariant must be False, 'batch' .* or 'portable' .*, got 1"):
        Plan(invariant=1)
    assert Plan(invariant=True).invariant == "portable"


def test_the_batch_mode_refuses_what_its_pins_are_not_measured_on(qwen3):
    """Off the CPU (its tiles are the CPU kernels'), float16 (not measured): refused naming the portable mode."""
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = load_checkpoint(qwen3, mesh, Plan(invariant="batch"))
    for backend in (Backend("aot_eager", "cuda"), Backend("npugraph_ex", "npu")):
        with pytest.raises(
            ValueError, match=r"Plan.invariant='batch' on (cuda|npu): .* use Plan\(invariant='portable'\)"
        ):
            invariant_options(params, params.placement, backend, "compile_model")
    half = load_checkpoint(qwen3, mesh, Plan(invariant="batch"), dtype=torch.float16)
    with pytest.raises(ValueError, match=r"compile_model: Plan.invariant='batch': .* not torch.float16; .*'portable'"):
        compile_model(half, mesh, backend="none")
    with pytest.raises(ValueError, match=r"Plan.invariant must be False, 'batch' .* got 'fast'"):
        Plan(invariant="fast")


def test_on_the_npu_only_the_golden_graphs_run_it(qwen3, tmp_path):
    """torchair's GE graph and npugraph_ex's ACL graph of the dense decoder (graphs/qwen3-tp*-invariant-*) run it;
    torchair's captured mode and another family's graphs are refused, naming what runs it."""
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = load_checkpoint(qwen3, mesh, Plan(invariant=True))
    for name, mode in (("torchair", "max-autotune"), ("npugraph_ex", None)):
        assert invariant_options(params, params.placement, Backend(name, "npu", mode), "compile_model") == {}
    with pytest.raises(ValueError, match=r"backend 'torchair' in mode 'reduce-overhead': .* use mode 'max-autotune'"):
        invariant_options(params, params.placement, Backend("torchair", "npu", "reduce-overhead"), "compile_model")
    save_tiny_moe("qwen3_moe", tmp_path, 5)
    moe = load_checkpoint(str(tmp_path), mesh, Plan(invariant=True))
    with pytest.raises(
        ValueError, match=r"are those of LlamaForCausalLM / .*Qwen3ForCausalLM, not Qwen3MoeForCausalLM's"
    ):
        invariant_options(moe, moe.placement, Backend("npugraph_ex", "npu"), "compile_model")


def test_a_plan_given_beside_the_params_turns_it_on(qwen3):
    """``invariant`` decides no layout: params loaded without it compile under a plan with it."""
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = load_checkpoint(qwen3, mesh)
    model = compile_model(params, mesh, plan=dataclasses.replace(Plan(), invariant=True), backend="none",
                          batch_sizes=[4], max_seq_len=16, prefill_lengths=[8])  # fmt: skip
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    s = model.sample(prompts, NEW, seed=1)
    batch = policy_batch(prompts, s, [0.0, 0.0])
    assert logprob_gap(token_logprobs(model.params, batch.tokens, mesh), batch) == 0.0
