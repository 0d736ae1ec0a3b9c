"""Gemma 3 text against transformers: tiny random models (sliding and full layers interleaved, the window shorter
than every prompt, each layer type with its own rope base, linear scaling on full layers, random ``1 + weight``
norms, a query scale other than head_dim's, soft-capped logits; tied and untied, the older flat config.json)
saved with save_pretrained; prefill logits (1e-4) and 16 greedy tokens at tp 1 and 2, eager, and compiled at
tp 2 for one config. Each of those traits moves the logits far past the tolerance when it is left out."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import transformers as T

from functional_npu import Params

from ..support.hf_models import GEMMA3_FAMILIES, GEMMA3_ROPE, check_parity, hf_references, save_tiny_gemma3
from ..support.workers import llama_generate

PROMPT_LENS = (5, 12, 9)
NEW = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return hf_references(
        tmp_path_factory,
        save_tiny_gemma3,
        GEMMA3_FAMILIES,
        seed=7,
        model_seed=700,
        prompt_lens=PROMPT_LENS,
        new=NEW,
    )


@pytest.mark.parametrize("family", list(GEMMA3_FAMILIES))
def test_parity_tp1(models, family):
    path, prompts, _, _ = models[family]
    check_parity(llama_generate(None, path, 1, prompts, NEW, False), models[family])


# compiled at tp 2 only, for one config (compiling costs CI time; tp 2 compiles the tp 1 graph's ops and collectives)
@pytest.mark.parametrize(
    "family,use_compile",
    [(f, False) for f in GEMMA3_FAMILIES] + [("gemma3", True)],
    ids=lambda x: {False: "eager", True: "compiled"}.get(x, x),
)
def test_parity_tp2(world2, models, family, use_compile):
    """Heads over tp (gemma3_flat's one KV head replicated), o_proj and down row-parallel, the embedding and head
    vocab-parallel."""
    path, prompts, _, _ = models[family]
    results = world2.run(llama_generate, path, 2, prompts, NEW, use_compile)
    for r in results:
        check_parity(r, models[family])
    if use_compile:
        ops = results[0][3]
        assert "_c10d_functional.all_reduce" in ops and "_c10d_functional.all_gather_into_tensor" in ops


def test_module_tp_over_dp2(world2, models):
    """o_proj, the MLP, the embedding and the tied head TP'd over both dp ranks, each rank its own prompts."""
    from ..support.module_tp_workers import check_every_module_over_dp2

    check_every_module_over_dp2(world2, models["gemma3"], NEW)


def test_every_layer_leaf_layer_sharded_with_prefetch(world2, models):
    """Each layer's whole weights (the post-norms too) on one of 2 dp ranks, fetched one layer ahead."""
    from functional_npu import Plan, read_config
    from functional_npu.cli.runner import generate_on_rank, in_prompt_order
    from functional_npu.models import series_leaves

    path, prompts, _, ref_tokens = models["gemma3"]
    plan = Plan(layer_shard="layer", prefetch_step=1)
    assert {"post_attn_norm", "post_mlp_norm"} <= set(series_leaves(read_config(path), plan.layer_shard).leaves)
    results = world2.run(generate_on_rank, path, {"dp": 2, "tp": 1}, prompts, NEW, backend="none", plan=plan)
    assert in_prompt_order(results, len(prompts)) == ref_tokens


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": None},  # sliding layers see every position
        {"rope_local_base_freq": GEMMA3_ROPE["full_attention"]["rope_theta"]},  # one rope base for both types
        {"rope_type": "default"},  # full layers unscaled
        {"final_logit_softcapping": None},
        {"query_pre_attn_scalar": 32},  # head_dim's scale
    ],
    ids=lambda change: next(iter(change)),
)
def test_each_trait_moves_the_logits(models, change):
    """The counterexamples: the parity models' logits with one trait left out differ from transformers' by far more
    than the parity tolerance, so the parity tests check each of them."""
    from functional_npu import Mesh
    from functional_npu.models import forward, init_state
    from functional_npu.runtime.loading.checkpoint import load_checkpoint

    path, prompts, ref_logits, _ = models["gemma3"]
    mesh = Mesh.abstract({"tp": 1}, 0)
    params = load_checkpoint(path, mesh)
    params = Params(params.tree, dataclasses.replace(params.config, **change))
    prompt = prompts[1]  # 12 tokens: 8 past the window
    state = init_state(params.config, mesh, 1, len(prompt))
    with torch.no_grad():
        logits = forward(params, torch.tensor([prompt]), torch.arange(len(prompt))[None], state, mesh)[0]
    assert (logits - ref_logits[1]).abs().max().item() > 1e-2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types must give one of"),
        (
            {"rope_parameters": GEMMA3_ROPE | {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
            "rope_parameters.full_attention.rope_type 'yarn' is not supported; supported: default, linear",
        ),
        (
            {"rope_parameters": GEMMA3_ROPE | {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "rope_parameters.sliding_attention.rope_type 'linear' is not supported; supported: default",
        ),
    ],
)
def test_unsupported_options_are_refused_in_one_line(models, change, message):
    from functional_npu.models import Gemma3Config

    hf = json.loads((Path(models["gemma3"][0]) / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        Gemma3Config.from_hf(hf)
    assert str(err.value).startswith("config.json: ") and "\n" not in str(err.value)


def test_the_flat_config_reads_as_transformers_reads_it(models):
    """The older config.json form (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern) means
    the saved model to transformers and to the loader alike; the nested form this config writes reads back."""
    from functional_npu.models import Gemma3Config
    from functional_npu.runtime.loading.checkpoint import read_config

    path = models["gemma3_flat"][0]
    hf = T.AutoConfig.from_pretrained(path)
    cfg = read_config(path)
    assert list(cfg.layer_types) == hf.layer_types == ["sliding_attention", "full_attention"] * 2
    assert hf.rope_parameters == GEMMA3_ROPE
    assert Gemma3Config.from_hf(cfg.to_hf()) == cfg
    assert T.Gemma3TextConfig(**cfg.to_hf()).rope_parameters == GEMMA3_ROPE


def test_a_saved_checkpoint_is_transformers_model(models, tmp_path):
    """Loaded, saved back (the untied form: lm_head, the four norms, [q|k|v] and [gate|up] split to HF tensors) and
    read by transformers: the same logits."""
    from functional_npu import Mesh
    from functional_npu.runtime.loading.checkpoint import load_checkpoint
    from functional_npu.runtime.loading.save import save_checkpoint

    path, prompts, ref_logits, _ = models["gemma3_flat"]
    save_checkpoint(load_checkpoint(path, Mesh.abstract({"tp": 1}, 0)), tmp_path)
    model = T.Gemma3ForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompts[1]])).logits[0]
    assert (logits - ref_logits[1]).abs().max().item() < 1e-5
