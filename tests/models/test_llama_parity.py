"""Parity with transformers: tiny random Llama / Mistral / Qwen2 / Qwen3 models saved with save_pretrained,
loaded at tp = 1, 2, 4 (gloo), prefill logits (1e-4 abs) and 16 greedy tokens, eager and compiled (at tp 2 and
one family at tp 4)."""

import pytest

from ..support.hf_models import FAMILIES, check_parity, hf_references, save_tiny
from ..support.workers import llama_generate

PROMPT_LENS = (5, 12, 9)
NEW = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (dir, prompts, hf logits per prompt, hf greedy tokens per prompt)}; references computed once."""
    return hf_references(
        tmp_path_factory,
        save_tiny,
        FAMILIES,
        seed=0,
        model_seed=100,
        prompt_lens=PROMPT_LENS,
        new=NEW,
        uncached=("mistral",),
    )


def test_sharded_index_checkpoint_is_used(models):
    import pathlib

    assert (pathlib.Path(models["qwen3"][0]) / "model.safetensors.index.json").is_file()


# eager at tp 1: each family's compiled forward is checked at tp 2 below (the same graph with its collectives), and
# compiled at tp 1 in tests/runtime/test_compile.py (compiling costs CI time)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_parity_tp1(models, family):
    path, prompts, _, _ = models[family]
    check_parity(llama_generate(None, path, 1, prompts, NEW, False), models[family])


@pytest.mark.parametrize("use_compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_parity_tp2(world2, models, family, use_compile):
    path, prompts, _, _ = models[family]
    results = world2.run(llama_generate, path, 2, prompts, NEW, use_compile)
    for r in results:
        check_parity(r, models[family])
    if use_compile:
        ops = results[0][3]
        assert "_c10d_functional.all_reduce" in ops and "_c10d_functional.all_gather_into_tensor" in ops


# compiled at tp 4 only for qwen2, whose one KV head is replicated on every rank (compiling costs CI time)
@pytest.mark.parametrize(
    "family,use_compile",
    [(f, False) for f in FAMILIES] + [("qwen2", True)],
    ids=lambda x: {False: "eager", True: "compiled"}.get(x, x),
)
def test_parity_tp4(world4, models, family, use_compile):
    path, prompts, _, _ = models[family]
    for r in world4.run(llama_generate, path, 4, prompts, NEW, use_compile):
        check_parity(r, models[family])
