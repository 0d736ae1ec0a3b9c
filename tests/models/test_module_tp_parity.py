"""Module TP over data-parallel ranks (seed 003's o_proj / lm_head / embedding / MLP groups) against
transformers: tiny random models saved with save_pretrained, every module alone and all together at
dp 2 x tp 1, dp 2 x tp 2 and dp 4 x tp 1 (no world above 4 ranks on a 2-core machine), composed with layer
sharding; prefill logits (1e-4), greedy tokens, the greedy head's argmax, each rank's slices and the bytes it read.
Eager on gloo; one compiled case (all modules and layer sharding at once: compiling is what costs CI time)."""

import pytest

from ..support.hf_models import hf_references, save_tiny
from ..support.module_tp_workers import module_tp_generate

PROMPT_LENS = (5, 12, 9, 7)
NEW = 8
ALONE = [{"o_proj": 2}, {"lm_head": 2}, {"embed": 2}, {"mlp": 2}]
ALL2 = {"o_proj": 2, "lm_head": 2, "embed": 2, "mlp": 2}


def _four_layers(name, path, seed):
    return save_tiny(name, path, seed, num_hidden_layers=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """qwen3 (untied, q/k norm), llama3 (tied embeddings), and a 4-layer qwen3 for layer sharding."""
    refs = hf_references(
        tmp_path_factory, save_tiny, ("qwen3", "llama3"), seed=1, model_seed=300, prompt_lens=PROMPT_LENS, new=NEW
    )
    deep = hf_references(
        tmp_path_factory, _four_layers, ("qwen3",), seed=1, model_seed=400, prompt_lens=PROMPT_LENS, new=NEW
    )
    return refs | {"qwen3-4l": deep["qwen3"]}


def _check(results, reference, plans, tp, *, logits=True):
    """Every rank's prompts against transformers, and each module's weight cut over its group and tp."""
    _, prompts, ref_logits, ref_tokens = reference
    for rank, per_plan in enumerate(results):
        for sizes, r in zip(plans, per_plan):
            where = f"rank {rank}, plan {sizes}"
            assert r["read"] == r["bytes"], f"{where}: read {r['read']} bytes for {r['bytes']} local ones"
            for j, i in enumerate(r["indices"]):
                n = len(prompts[i])
                assert r["tokens"][j] == ref_tokens[i], f"{where}: prompt {i}'s greedy tokens differ"
                if logits:
                    err = (r["logits"][j, :n] - ref_logits[i]).abs().max().item()
                    assert err < 1e-4, f"{where}: prompt {i}'s prefill logits differ by {err}"
                    assert r["argmax"][j, :n].tolist() == r["logits"][j, :n].argmax(-1).tolist(), where
            _check_slices(r, sizes, tp, where)
        covered = sorted(i for r in (p[0] for p in results) for i in r["indices"])
        assert set(covered) == set(range(len(prompts)))


def _check_slices(r, sizes, tp, where):
    """Each module's weight holds 1 / (n tp) of its split dim (a layer-sharded one: of each owned layer)."""
    cut = {
        "o_proj": ("layers.0.o_proj", 1),
        "lm_head": ("lm_head", 0),
        "embed": ("embed", 0),
        "mlp": ("layers.0.down", 1),
    }
    for module, (path, dim) in cut.items():
        if path not in r["full"]:  # a tied model has no lm_head
            continue
        full = r["full"][path][dim]
        series = "series." + path.split(".")[-1]
        local = r["shapes"][series][dim + 1] if series in r["shapes"] else r["shapes"][path][dim]
        n = sizes.get(module, 1)
        assert local == full // (n * tp), f"{where}: {path} holds {local} of {full} (module TP {n}, tp {tp})"


def test_each_module_alone_and_all_dp2_tp1(world2, models):
    plans = [*ALONE, ALL2]
    _check(
        world2.run(module_tp_generate, models["qwen3"][0], 2, 1, plans, models["qwen3"][1], NEW),
        models["qwen3"],
        plans,
        1,
    )


def test_tied_embeddings_dp2_tp1(world2, models):
    plans = [{"embed": 2, "lm_head": 2}, ALL2]
    _check(
        world2.run(module_tp_generate, models["llama3"][0], 2, 1, plans, models["llama3"][1], NEW),
        models["llama3"],
        plans,
        1,
    )


def test_each_module_alone_and_all_dp2_tp2(world4, models):
    plans = [*ALONE, ALL2]
    _check(
        world4.run(module_tp_generate, models["qwen3"][0], 2, 2, plans, models["qwen3"][1], NEW),
        models["qwen3"],
        plans,
        2,
    )


def test_nested_sizes_dp4_tp1(world4, models):
    """Groups of 2 and 4 dp ranks in one mesh: dp -> (dp 1, dp4 2, dp2 2)."""
    plans = [{"o_proj": 2, "lm_head": 4, "embed": 4, "mlp": 2}, {"o_proj": 4, "mlp": 4}]
    _check(
        world4.run(module_tp_generate, models["qwen3"][0], 4, 1, plans, models["qwen3"][1], NEW),
        models["qwen3"],
        plans,
        1,
    )


def test_composed_with_layer_sharding_dp4_tp1(world4, models):
    """o_proj and down cut over dp2 and layer-sharded over the outer dp (2 ranks), fetched one layer ahead."""
    path, prompts = models["qwen3-4l"][:2]
    plans = [{"o_proj": 2, "mlp": 2}, ALL2]
    results = world4.run(module_tp_generate, path, 4, 1, plans, prompts, NEW, series="o_proj,down_proj", k=1)
    _check(results, models["qwen3-4l"], plans, 1)
    assert results[0][0]["shapes"]["series.o_proj"][0] == 2  # 2 of the 4 layers' o_proj on each outer dp rank


def test_compiled_composed_dp4_tp1(world4, models):
    path, prompts = models["qwen3-4l"][:2]
    """Every module TP'd over dp2 and o_proj / down layer-sharded over the outer dp, under inductor."""
    plans = [ALL2]
    results = world4.run(
        module_tp_generate, path, 4, 1, plans, prompts, NEW, backend="inductor", series="o_proj,down_proj", k=1
    )
    _check(results, models["qwen3-4l"], plans, 1, logits=False)
