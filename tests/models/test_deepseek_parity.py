"""DeepSeek-V2/V3 against transformers: tiny random models (MLA with and without a low-rank query, yarn rope,
interleaved and halves rope layouts, group-limited sigmoid and softmax routing, the correction bias, shared
experts, dense first layers) saved with save_pretrained; prefill logits (1e-4) and 16 greedy tokens
(decoded through the absorbed latent path), at tp 1 and 2 and with experts over 2 ranks, eager, and
compiled for one config."""

import re
from pathlib import Path

import pytest
import torch

from ..support.hf_models import DEEPSEEK_FAMILIES, hf_references, save_tiny_deepseek
from ..support.workers import llama_generate, moe_generate

PROMPT_LENS = (5, 12, 9)
NEW = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """transformers' cached generate of DeepSeek-V2 parts from its own uncached forward on one of these prompts
    (its V2 cache path, not the model's math): V2's tokens are taken without a cache."""
    return hf_references(
        tmp_path_factory,
        save_tiny_deepseek,
        DEEPSEEK_FAMILIES,
        seed=3,
        model_seed=500,
        prompt_lens=PROMPT_LENS,
        new=NEW,
        uncached=("deepseek_v2",),
    )


def _check(logits, tokens, reference, order=None):
    _, prompts, ref_logits, ref_tokens = reference
    for row, i in enumerate(order or range(len(prompts))):
        n = len(prompts[i])
        err = (logits[row, :n] - ref_logits[i]).abs().max().item()
        assert err < 1e-4, f"prompt {i}: prefill logits differ by {err}"
        assert tokens[row] == ref_tokens[i], f"prompt {i}: greedy tokens differ"


@pytest.mark.parametrize("family", list(DEEPSEEK_FAMILIES))
def test_parity_tp1(models, family):
    logits, tokens, _, _ = llama_generate(None, models[family][0], 1, models[family][1], NEW, False)
    _check(logits, tokens, models[family])


def test_parity_tp1_compiled(models):
    logits, tokens, _, ops = llama_generate(None, models["deepseek_v3"][0], 1, models["deepseek_v3"][1], NEW, True)
    _check(logits, tokens, models["deepseek_v3"])


@pytest.mark.parametrize("family", list(DEEPSEEK_FAMILIES))
def test_parity_tp2(world2, models, family):
    """Heads split over tp (q_b_proj / kv_b_proj column-, o_proj row-parallel), the latent cache replicated;
    each rank reads only its slices."""
    results = world2.run(llama_generate, models[family][0], 2, models[family][1], NEW, False)
    for rank, (logits, tokens, read, _) in enumerate(results):
        _check(logits, tokens, models[family])
        assert read == _local_bytes(models[family][0], {"dp": 1, "tp": 2}, rank)


def test_parity_ep2(world2, models):
    """Routed experts over 2 ranks (each holds 4), shared experts replicated; ranks run different prompts."""
    ref = models["deepseek_v3"]
    order = list(range(len(ref[1])))
    results = world2.run(moe_generate, ref[0], {"dp": 2, "tp": 1}, ("dp",), ref[1], NEW, False)
    for rank, (rot, logits, tokens, read, _) in enumerate(results):
        _check(logits, tokens, ref, order[rot:] + order[:rot])
        assert read == _local_bytes(ref[0], {"dp": 2, "tp": 1}, rank, ("dp",))


def _local_bytes(path, axes, rank, expert_axes=()):
    """The bytes of one rank's shards: what it must read, no more."""
    from functional_npu import Mesh, Plan, flatten_with_paths
    from functional_npu.runtime.loading.checkpoint import load_checkpoint

    local = load_checkpoint(path, Mesh.abstract(axes, rank), Plan(expert_axes=expert_axes))
    return sum(x.numel() * x.element_size() for p, x in flatten_with_paths(local) if not p.endswith("expert_map"))


def test_absorbed_decode_equals_the_plain_path_and_the_cache_is_latent(models):
    """A decode step through the absorbed latent path and through the expanded keys / values: the same logits;
    the cache holds kv_lora_rank + qk_rope_head_dim values per token and layer, shared by all heads."""
    from functional_npu import Mesh, Plan, compile_model, load_checkpoint

    mesh = Mesh.abstract({"tp": 1}, 0)
    params = load_checkpoint(models["deepseek_v3"][0], mesh)
    cfg, prompts = params.config, models["deepseek_v3"][1]
    out = {}
    for mode in ({"absorb": True}, {"absorb": False}, {"mla_cache": "heads"}):
        model = compile_model(params, mesh, backend="none", plan=Plan(**mode))
        state = model.new_state(len(prompts))
        first = model.prefill(prompts, state).argmax(-1)
        out[str(mode)] = model.decode(first, torch.tensor([len(p) for p in prompts]), state)
        keys, values = state.kv[0]
        if "mla_cache" in mode:  # the baseline: every head's keys and values
            assert keys.shape[1] == values.shape[1] == cfg.num_heads
        else:
            assert (
                keys.shape[1:] == (1, model.max_seq_len, cfg.kv_lora_rank) and values.shape[-1] == cfg.qk_rope_head_dim
            )
    ref = out[str({"absorb": True})]
    assert all((x - ref).abs().max().item() < 1e-4 for x in out.values())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention_bias": True}, "attention_bias / mlp_bias are not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, "fp8 block-quantized weights"),
        ({"index_topk": 2048}, "index_topk (DeepSeek-V3.2 sparse attention) is not supported"),
        ({"topk_method": "noaux_tc", "architectures": ["DeepseekV2ForCausalLM"]}, "topk_method 'noaux_tc'"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "rope_type 'longrope' is not supported"),
    ],
)
def test_unsupported_options_are_refused_in_one_line(models, change, message):
    import json

    from functional_npu.models import DeepseekConfig

    hf = json.loads((Path(models["deepseek_v3"][0]) / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=re.escape(message)):
        DeepseekConfig.from_hf(hf)


def test_a_tp_that_does_not_divide_the_heads_is_named(models):
    from functional_npu import Mesh, Plan
    from functional_npu.placement import check_plan
    from functional_npu.runtime.loading.checkpoint import read_config

    cfg = read_config(models["deepseek_v3"][0])
    with pytest.raises(ValueError, match=r"specs\['layers.0.q_b_proj'\].*'tp' \(size 8\)"):
        check_plan(cfg, Mesh.abstract({"tp": 8}))  # 4 heads
    with pytest.raises(ValueError, match=r"experts_gate_up"):
        check_plan(cfg, Mesh.abstract({"dp": 3, "tp": 1}), Plan(expert_axes=("dp",)))


def test_module_tp_over_dp2(world2, models):
    """o_proj, the dense layer's MLP, the embedding and lm_head TP'd over both dp ranks (MLA attention and the
    experts replicated, each rank its own prompts)."""
    from ..support.module_tp_workers import check_every_module_over_dp2

    check_every_module_over_dp2(world2, models["deepseek_v3"], NEW)


def test_mla_projections_layer_sharded_with_prefetch(world2, models):
    """q_b_proj, kv_b_proj and o_proj of every layer on one of 2 dp ranks, fetched one layer ahead."""
    from functional_npu import Plan
    from functional_npu.cli.runner import generate_on_rank, in_prompt_order

    path, prompts, _, ref_tokens = models["deepseek_v3"]
    plan = Plan(layer_shard="q_b_proj,kv_b_proj,o_proj", prefetch_step=1)
    results = world2.run(generate_on_rank, path, {"dp": 2, "tp": 1}, prompts, NEW, backend="none", plan=plan)
    assert in_prompt_order(results, len(prompts)) == ref_tokens


def test_mtp_layers_are_left_unread_and_a_wrong_shape_names_the_sizes(models, tmp_path):
    """A checkpoint holding a multi-token-prediction layer after the decoder's (as DeepSeek-V3's do) loads the
    decoder and reads nothing of it; a tensor of the wrong shape is named with the config's MLA sizes."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from functional_npu import Mesh
    from functional_npu.runtime.loading.checkpoint import load_checkpoint

    src = Path(models["deepseek_v3"][0])
    state = load_file(src / "model.safetensors")
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    mtp = {k.replace(".layers.1.", f".layers.{layers}."): v.clone() for k, v in state.items() if ".layers.1." in k}
    shutil.copy(src / "config.json", tmp_path / "config.json")
    save_file(state | mtp, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    names: list[str] = []
    load_checkpoint(tmp_path, Mesh.abstract({"tp": 1}, 0), on_read=lambda name, _: names.append(name))
    assert names and not any(f".layers.{layers}." in n for n in names)
    bad = state | {"model.layers.0.self_attn.kv_b_proj.weight": torch.zeros(3, 16)}
    save_file(bad, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"kv_b_proj.weight.*has shape \(3, 16\).*kv_lora_rank=16"):
        load_checkpoint(tmp_path, Mesh.abstract({"tp": 1}, 0))
