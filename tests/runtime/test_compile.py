"""compile_model: whole-graph prefill/decode on static shape buckets, generation parity, sampling, errors."""

import dataclasses

import pytest
import torch

from functional_npu import CompileOptions, Mesh, Params, compile_model, greedy_generate, load_checkpoint, shard
from functional_npu.models import forward, llama
from functional_npu.runtime.serving import GraphBreakError
from functional_npu.runtime.serving.generate import Lockstep

from ..support.hf_models import hf_greedy, save_tiny

PROMPTS = [[5, 9, 2], [7] * 11, [1, 2, 3, 4, 5, 6]]
NEW = 8


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    model = save_tiny("qwen3", path, 7)
    return str(path), [hf_greedy(model, p, NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def compiled(qwen3):
    mesh = Mesh.abstract({"tp": 1}, 0)
    torch._dynamo.reset()
    return compile_model(load_checkpoint(qwen3[0], mesh), mesh, batch_sizes=[1, 4], max_seq_len=64)


def test_generate_matches_transformers_with_padded_buckets(compiled, qwen3):
    assert compiled.backend.name == "inductor"
    assert compiled.prefill_lengths == (16, 32, 64)
    assert compiled.generate(PROMPTS, NEW) == qwen3[1]  # 3 prompts padded to the batch-4 bucket, length 16
    assert compiled.generate(PROMPTS[:1], NEW) == qwen3[1][:1]  # batch-1 bucket


def test_sampling_is_seeded_and_top_k_1_is_greedy(compiled, qwen3):
    a = compiled.generate(PROMPTS, NEW, temperature=1.0, top_p=0.9, seed=3)
    assert a == compiled.generate(PROMPTS, NEW, temperature=1.0, top_p=0.9, seed=3)
    assert compiled.generate(PROMPTS, NEW, temperature=0.7, top_k=1, seed=5) == qwen3[1]
    assert all(0 <= t < 128 for row in a for t in row)


def test_compile_model_errors(compiled, qwen3):
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = compiled.params
    with pytest.raises(TypeError, match=r"^compile_model: params must be a functional_npu.Params .* got dict"):
        compile_model(dict(params.items()), mesh)
    with pytest.raises(TypeError, match=r"^compile_model: params carry no model config \(params.config is None\)"):
        compile_model(Params(params.tree), mesh)
    with pytest.raises(ValueError, match=r"the params were placed for mesh \{'tp': 1\} .* but the mesh is \{'dp': 1\}"):
        compile_model(params, Mesh.abstract({"dp": 1}, 0))
    tp2 = shard(params, llama.param_specs(params.config), Mesh.abstract({"tp": 2}, 0))
    with pytest.raises(
        ValueError,
        match=r"params\['embed'\] has shape \(64, 64\) but mesh \{'tp': 1\} at \{'tp': 0\} expects \(128, 64\); "
        r"were the params sharded for another mesh\?",
    ):
        compile_model(tp2, mesh)
    with pytest.raises(ValueError, match=r"kernels='gpu' is not one of \('cpu', 'npu', 'dense'\)"):
        compile_model(params, mesh, kernels="gpu")
    with pytest.raises(ValueError, match=r"generate: 11 prompt tokens \+ 60 new exceed max_seq_len 64"):
        compiled.generate(PROMPTS, 60)
    with pytest.raises(ValueError, match=r"sampling: top_p must be a number in \(0, 1\] \(None: no cut\), got 0.0"):
        compiled.generate(PROMPTS, 2, temperature=1.0, top_p=0.0)
    for bad in (float("nan"), float("inf"), -1.0, "1", 1e-300):  # 1e-300: logits / temperature would overflow
        with pytest.raises(ValueError, match=r"sampling: temperature must be 0 \(greedy\) or a finite number >= 1e-06"):
            compiled.generate(PROMPTS, 2, temperature=bad)
    for prompts, message in (
        ([[1, True]], r"generate: prompt 0 holds True \(bool\); token ids are ints"),
        ([[1.5, 2]], r"generate: prompt 0 holds 1.5 \(float\); token ids are ints"),
        (["abc"], r"generate: prompt 0 is a str; give a list of int token ids"),
        ("abc", r"generate: prompts must be a list of token-id lists, got str"),
    ):
        with pytest.raises(TypeError, match=message):
            compiled.sample(prompts, 2)
    for new in (2.0, True, 0):
        with pytest.raises(ValueError, match=r"generate: max_new_tokens must be an int >= 1, got "):
            compiled.sample([[1, 2]], new)
    with pytest.raises(ValueError, match=r"sampling: seed must be an int in \[0, 2\*\*64\)"):
        compiled.generate(PROMPTS, 2, temperature=1.0, seed=2**70)
    with pytest.raises(
        ValueError,
        match=r"prompt length 70 exceeds the largest bucket 64 \(the compiled buckets: \[16, 32, 64\]\); pass ",
    ):
        compiled.prefill([[1] * 70], compiled.new_state(1))
    with pytest.raises(
        ValueError,
        match=r"batch size 9 exceeds the largest bucket 4 \(the compiled buckets: \[1, 4\]\); pass batch_sizes with a",
    ):
        compiled.new_state(9)
    positions = params.config.max_position_embeddings
    with pytest.raises(
        ValueError,
        match=rf"compile_model: max_seq_len {positions + 1} exceeds the model's {positions} positions "
        rf"\(max_position_embeddings\); pass max_seq_len <= {positions}",
    ):
        compile_model(params, mesh, backend="none", max_seq_len=positions + 1)


def test_graph_break_is_an_error_naming_its_cause(compiled):
    def breaks(params, tokens, positions, state, mesh, last=None):
        torch._dynamo.graph_break()
        return forward(params, tokens, positions, state, mesh, last)

    torch._dynamo.reset()
    bad = dataclasses.replace(compiled, forward=compiled.backend.compile(breaks, dynamic=False))
    with pytest.raises(
        GraphBreakError, match=r"prefill graph of Qwen3ForCausalLM breaks under fullgraph tracing: .*graph_break"
    ):
        bad.generate(PROMPTS[:1], 2)


def test_cache_length_is_the_smallest_power_of_two_that_fits():
    from functional_npu.runtime.serving import cache_length

    assert [cache_length(n) for n in (1, 64, 65, 128, 129)] == [64, 64, 128, 128, 256]
    assert cache_length(5, minimum=1) == 8
    # within a model's positions: 70 tokens of a 100-position model get 100, not 128 (which compile_model refuses)
    assert [cache_length(70, limit=100), cache_length(5, limit=100), cache_length(100, limit=100)] == [100, 64, 100]


@pytest.fixture(scope="module")
def plain(qwen3):
    """The same model on backend 'none': the plain forward through the same generation path."""
    mesh = Mesh.abstract({"tp": 1}, 0)
    return compile_model(load_checkpoint(qwen3[0], mesh), mesh, backend="none", batch_sizes=[1, 4], max_seq_len=64)


def test_plain_backend_honours_every_option(plain, qwen3):
    assert plain.generate(PROMPTS, NEW) == qwen3[1]
    sampled = plain.generate(PROMPTS, NEW, temperature=1.5, seed=1)
    assert sampled == plain.generate(PROMPTS, NEW, temperature=1.5, seed=1) != qwen3[1]
    assert plain.generate(PROMPTS, NEW, temperature=0.7, top_k=1, seed=5) == qwen3[1]
    assert greedy_generate(plain.params, PROMPTS, NEW, plain.mesh) == qwen3[1]


def test_lockstep_pads_chunks_and_rows_and_keeps_results(plain, qwen3):
    assert Lockstep.over(5, 2, 11, (1, 2, 4, 8)) == Lockstep(chunks=1, batch=4, prompt_len=11)
    assert Lockstep.over(20, 2, 3, (1, 2, 4, 8)) == Lockstep(chunks=2, batch=8, prompt_len=3)
    assert Lockstep.over(1, 4, 2, (1, 2, 4, 8)) == Lockstep(chunks=1, batch=1, prompt_len=2)
    assert plain.generate([], NEW, lockstep=Lockstep(2, 2, 11)) == []  # an idle rank still steps with its group
    assert plain.generate(PROMPTS, NEW, lockstep=Lockstep(2, 2, 11)) == qwen3[1]  # 2 + 1 rows, then a dummy row
    with pytest.raises(ValueError, match=r"generate: 3 prompts need 2 chunks of 2, more than the lockstep's 1"):
        plain.generate(PROMPTS, NEW, lockstep=Lockstep(1, 2, 11))


def test_greedy_generate_names_params_sharded_for_another_mesh(plain):
    tp2 = shard(plain.params, llama.param_specs(plain.config), Mesh.abstract({"tp": 2}, 0))
    with pytest.raises(ValueError, match=r"params\['embed'\] has shape \(64, 64\) but mesh \{'tp': 1\}"):
        greedy_generate(tp2, PROMPTS, 2, plain.mesh)


def test_token_ids_outside_the_vocabulary_are_refused_on_every_path(plain, compiled):
    paths = [plain.generate, compiled.generate, lambda p, n: greedy_generate(plain.params, p, n, plain.mesh)]
    for generate in paths:
        with pytest.raises(ValueError, match=r"prompt 1 has token ids \[128, -1\] outside the vocabulary \[0, 128\)"):
            generate([[1, 2], [128, 3, -1]], 2)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_seq_len": -4}, r"max_seq_len must be a positive int \(None: the default\), got -4"),
        ({"batch_sizes": [0, 2]}, r"batch_sizes must be positive ints, got \[0, 2\]"),
        ({"prefill_lengths": [-1, 8]}, r"prefill_lengths must be positive ints, got \[-1, 8\]"),
    ],
)
def test_compile_model_refuses_bad_shape_options(plain, options, message):
    with pytest.raises(ValueError, match=message):
        compile_model(plain.params, plain.mesh, backend="none", **options)


def test_compile_options_are_one_value_and_fields_given_one_by_one_go_over_it(plain):
    """``CompileOptions`` holds every option (frozen; a list given is held as a tuple); fields passed to
    ``compile_model`` replace the value's; a field that is not an option is a TypeError naming the ones there are."""
    options = CompileOptions(backend="none", batch_sizes=[2, 1], max_seq_len=32, prefill_lengths=[8])
    assert options.batch_sizes == (2, 1) and hash(options.batch_sizes)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.backend = "inductor"
    model = compile_model(plain.params, plain.mesh, options, max_seq_len=16)
    assert (model.backend.name, model.batch_sizes, model.max_seq_len, model.prefill_lengths) == (
        "none",
        (1, 2),
        16,
        (8,),
    )
    with pytest.raises(TypeError, match=r"^compile_model: no option 'batch_size'; the options are \['plan', 'backend'"):
        compile_model(plain.params, plain.mesh, options, batch_size=[1])
    with pytest.raises(TypeError, match=r"^compile_model: options must be a CompileOptions, got dict"):
        compile_model(plain.params, plain.mesh, {"backend": "none"})
    with pytest.raises(ValueError, match=r"^compile_model: linear='fast' is not one of \('streamed', 'matmul'\)"):
        CompileOptions(linear="fast")
    with pytest.raises(ValueError, match=r"^compile_model: cache_dir is ''"):
        CompileOptions(cache_dir="")


def test_generation_past_the_models_positions_is_refused_before_allocating(plain):
    with pytest.raises(ValueError, match=r"250 prompt tokens \+ 10 new exceed the model's 256 positions .* at most 6"):
        greedy_generate(plain.params, [[1] * 250], 10, plain.mesh)


def test_non_finite_logits_are_reported_not_turned_into_tokens(plain):
    layers = [dict(layer) for layer in plain.params["layers"]]
    layers[1]["down"] = layers[1]["down"].clone()
    layers[1]["down"][0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"generate: the model produced non-finite logits \(NaN or Inf\)"):
        greedy_generate(plain.params | {"layers": layers}, PROMPTS, 2, plain.mesh)


@pytest.mark.parametrize("greedy_head", [False, True], ids=["logits", "argmax-head"])
def test_a_nan_raised_in_a_decode_step_is_reported(plain, greedy_head):
    """The greedy head returns tokens, not logits: a step whose largest logit is NaN is still caught (-1)."""
    model = compile_model(plain.params, plain.mesh, backend="none", batch_sizes=[len(PROMPTS)], greedy_head=greedy_head)
    assert model.greedy_head is greedy_head
    state = model.new_state(len(PROMPTS))
    tokens = model.prefill(PROMPTS, state).argmax(-1)
    state.kv[0][0].fill_(float("nan"))  # the cache turns every later step's logits NaN
    pos = torch.tensor([len(p) for p in PROMPTS])
    if greedy_head:
        assert (model.decode_greedy(tokens, pos, state) == -1).all()
    else:
        assert torch.isnan(model.decode(tokens, pos, state)).all()
        with pytest.raises(ValueError, match=r"compile_model\(\.\.\., greedy_head=True\)"):
            model.decode_greedy(tokens, pos, state)


def test_the_greedy_head_generates_the_logits_paths_tokens(plain):
    want = compile_model(plain.params, plain.mesh, backend="none").generate(PROMPTS, 6)
    assert compile_model(plain.params, plain.mesh, backend="none", greedy_head=True).generate(PROMPTS, 6) == want


def test_the_linear_choice_is_checked_against_what_exists(plain, tmp_path):
    """``linear``: 'streamed' where inductor compiles for the CPU (the default there), 'matmul' anywhere; 'streamed'
    elsewhere, or on a model whose linears are all quantized, is one line naming what exists."""
    from functional_npu.core import Quant
    from functional_npu.models.linear import kernel_of
    from functional_npu.placement import QuantConfig
    from functional_npu.runtime.loading import save_checkpoint

    params, mesh = plain.params, plain.mesh
    with pytest.raises(ValueError, match=r"linear='fast' is not one of \('streamed', 'matmul'\) \(or None: the fast"):
        compile_model(params, mesh, backend="none", linear="fast")
    with pytest.raises(ValueError, match=r"linear='streamed' is .*, which backend 'none' does not run; here linear "
                       r"weights take 'matmul' \(torch's matmul\); pass linear=None or 'matmul'"):  # fmt: skip
        compile_model(params, mesh, backend="none", linear="streamed")
    kinds = {b: kernel_of(compile_model(params, mesh, backend="inductor", linear=b).params["lm_head"]) for b in
             ("streamed", "matmul", None)}  # fmt: skip
    assert kinds == {"streamed": "streamed", "matmul": "dense", None: "streamed"}
    full = llama.init_params(params.config, seed=0)
    path = save_checkpoint(full, tmp_path / "int8", quant=QuantConfig.of(Quant(8, "channel"), ()))
    int8 = load_checkpoint(path, mesh)
    with pytest.raises(ValueError, match=r"every linear weight of this model is quantized \(kernels \['w8'\]\); pass"):
        compile_model(int8, mesh, backend="inductor", linear="streamed")
    assert kernel_of(compile_model(int8, mesh, backend="inductor").params["lm_head"]) == "w8"


def test_greedy_picks_and_checks_logits_in_one_pass():
    """Greedy takes each row's first largest logit and trusts the logits unless a row's largest is NaN or infinite:
    exactly argmax, and exactly the rows that hold a NaN or an Inf, except -Inf beside finite values (masked)."""
    from functional_npu.runtime.serving.generate import _picked, greedy_pick, sampler

    assert sampler(0.0) is greedy_pick
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-2, 3, (6, 50), generator=g).float()  # many ties: the first largest must win
    tokens, finite = _picked(logits, greedy_pick)
    assert torch.equal(tokens, logits.argmax(-1)) and bool(finite)
    for bad, trusted in ((float("nan"), False), (float("inf"), False), (float("-inf"), True)):
        spoiled = logits.clone()
        spoiled[3, 7] = bad
        assert bool(_picked(spoiled, greedy_pick)[1]) is trusted
        assert bool(_picked(spoiled, lambda x: x.argmax(-1))[1]) is False  # a sampler checks every logit
    assert not bool(_picked(torch.full((2, 4), float("-inf")), greedy_pick)[1])


def test_shapes_past_the_graph_budget_are_refused_not_run_eagerly(compiled):
    """Without a ring too: 64 batch buckets x (4 prompt lengths + decode) = 320 graphs, past dynamo's recompile limit
    this library sets (256): the shapes past it would run eagerly with only a log line, so refused before tracing;
    the greedy head doubles the count."""
    mesh = Mesh.abstract({"tp": 1}, 0)
    with pytest.raises(
        ValueError,
        match=r"^compile_model: 64 batch buckets x \(4 prompt lengths \+ decode\) = 320 graphs, over the budget of "
        r"256: the shapes past it would run eagerly, not compiled or captured; pass fewer batch_sizes or",
    ):
        compile_model(compiled.params, mesh, batch_sizes=list(range(1, 65)), prefill_lengths=[8, 16, 32, 64],
                      max_seq_len=64)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"32 batch buckets x \(4 prompt lengths \+ decode\) x 2 \(greedy head\) = 320"
    ):
        compile_model(compiled.params, mesh, batch_sizes=list(range(1, 33)), prefill_lengths=[8, 16, 32, 64],
                      max_seq_len=64, greedy_head=True)  # fmt: skip


def test_serving_batches_without_a_graph_are_named_and_the_others_reported():
    from functional_npu.runtime.serving import batch_coverage
    from functional_npu.runtime.serving.compile_policy import uncovered

    got = batch_coverage((1, 2, 4, 8), [1, 3, 5, 8, 12])
    assert {n: c["bucket"] for n, c in got.items()} == {1: 1, 3: 4, 5: 8, 8: 8, 12: None}
    assert got[5]["padded"] == pytest.approx(3 / 8) and got[12]["padded"] is None
    assert uncovered((1, 2, 4, 8), [3, 9, 12]) == (
        "compile_model: serving batch sizes [9, 12] have no compiled graph (batch_sizes [1, 2, 4, 8]): generate "
        "refuses them and the engine runs at most 8 sequences at once; add a bucket of at least 12 to batch_sizes to "
        "serve them in one step"
    )
    assert uncovered((1, 2, 4, 8), [1, 8]) is None
    with pytest.raises(ValueError, match=r"serving_batches must be positive ints, got 0"):
        batch_coverage((1, 2), [0])


def test_compile_model_warns_naming_the_serving_batches_it_has_no_graph_for(compiled):
    mesh = Mesh.abstract({"tp": 1}, 0)
    with pytest.warns(UserWarning, match=r"serving batch sizes \[6\] have no compiled graph \(batch_sizes \[1, 4\]\)"):
        compile_model(compiled.params, mesh, backend="none", batch_sizes=[1, 4], max_seq_len=64,
                      serving_batches=[1, 3, 6])  # fmt: skip
