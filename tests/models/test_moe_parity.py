"""Parity with transformers' Qwen3MoeForCausalLM and MixtralForCausalLM (tiny random models saved with
save_pretrained, one tensor per expert): prefill logits (1e-4 abs) and 16 greedy tokens, with experts
replicated (ep 1), expert-parallel over 2 and 4 ranks, ep x tp = 2 x 2, and a redundant-expert placement.

Prefill (36 tokens per rank) takes the all_to_all dispatch, decode (3 tokens) the gather / reduce-scatter
path; ``test_both_dispatch_paths`` forces each path for a whole run. dp ranks run the prompts in different
orders, so the exchange mixes different tokens. Compiled (inductor, fullgraph): ep 2 over (dp, tp) with
tp = 2 (Qwen3-MoE), covering both dispatch paths and the token split over tp; the other cases run eager
(compiling the MoE graphs on 4 ranks costs about two minutes on a 2-core machine with a cold cache)."""

import pytest

from ..support.hf_models import MOE_FAMILIES, hf_references, save_tiny_moe
from ..support.workers import moe_generate

PROMPT_LENS = (5, 12, 9)
NEW = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (dir, prompts, hf logits per prompt, hf greedy tokens per prompt)}; references computed once."""
    return hf_references(
        tmp_path_factory, save_tiny_moe, MOE_FAMILIES, seed=1, model_seed=200, prompt_lens=PROMPT_LENS, new=NEW
    )


def _check(result, reference):
    _, prompts, ref_logits, ref_tokens = reference
    rot, logits, tokens, _, _ = result
    order = list(range(len(prompts)))
    order = order[rot:] + order[:rot]
    for row, i in enumerate(order):
        n = len(prompts[i])
        assert (logits[row, :n] - ref_logits[i]).abs().max().item() < 1e-4, f"prompt {i}: prefill logits differ"
        assert tokens[row] == ref_tokens[i], f"prompt {i}: greedy tokens differ"


def _run(world, models, family, axes, expert_axes, use_compile=False, **kw):
    path, prompts, _, _ = models[family]
    results = world.run(moe_generate, path, axes, expert_axes, prompts, NEW, use_compile, **kw)
    for r in results:
        _check(r, models[family])
    return results


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_parity_replicated_experts(models, family):
    path, prompts, _, _ = models[family]
    _check(moe_generate(None, path, {"tp": 1}, (), prompts, NEW, False), models[family])


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_parity_ep2(world2, models, family):
    from safetensors import safe_open

    results = _run(world2, models, family, {"dp": 2, "tp": 1}, ("dp",))
    with safe_open(f"{models[family][0]}/model.safetensors", "pt") as f:
        sizes = {k: f.get_tensor(k).numel() * 4 for k in f.keys()}
    experts = sum(v for k, v in sizes.items() if ".experts." in k)
    for r in results:  # every rank reads everything but the other rank's experts
        assert r[3] == sum(sizes.values()) - experts // 2


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_parity_ep4_over_dp_and_tp(world4, models, family):
    _run(world4, models, family, {"dp": 2, "tp": 2}, ("dp", "tp"))


def test_parity_ep2_x_tp2(world4, models):
    _run(world4, models, "mixtral", {"dp": 2, "tp": 2}, ("dp",))


def test_parity_ep2_over_tp_compiled(world2, models):
    """The CLI's --tp 2 --ep 2 plan (experts over the flattened (dp, tp) ranks, dp = 1), compiled with inductor."""
    ops = _run(world2, models, "qwen3_moe", {"dp": 1, "tp": 2}, ("dp", "tp"), use_compile=True)[0][4]
    assert {
        "_c10d_functional.all_to_all_single",
        "_c10d_functional.reduce_scatter_tensor",
        "_c10d_functional.all_gather_into_tensor",
    } <= set(ops)


@pytest.mark.parametrize("threshold", [0, 10**6], ids=["all_to_all", "gather"])
def test_both_dispatch_paths(world2, models, threshold):
    _run(world2, models, "qwen3_moe", {"dp": 2, "tp": 1}, ("dp",), threshold=threshold)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_parity_redundant_placement(world2, models, family):
    # experts shuffled over 10 slots, experts 0 and 5 with a second copy on the other rank
    placement = ([0, 5], [3, 0, 6, 1, 7, 2, 5, 4])
    _run(world2, models, family, {"dp": 2, "tp": 1}, ("dp",), placement=placement)
