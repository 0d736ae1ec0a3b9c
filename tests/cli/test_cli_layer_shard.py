"""``generate --layer-shard``: layer-sharded weights over dp with prefetch, through the CLI, against transformers;
bad arguments are one clear line and exit code 2."""

import pytest

from ..support.cli import PROMPTS, generate_json, refused
from ..support.hf_models import hf_greedy, save_tiny


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_cli_ls")
    hf = save_tiny("qwen3", path, 5, num_hidden_layers=4)
    return path, PROMPTS, [hf_greedy(hf, p, 5) for p in PROMPTS]


@pytest.mark.parametrize("step", ["1", "auto"])
def test_generate_layer_sharded_over_dp_with_prefetch(qwen3, step):
    """dp 2 with 3 prompts (2 and 1 per rank): the ranks share every broadcast and still return prompt order;
    ``auto`` reports the step the cost model chose."""
    path, prompts, ref = qwen3
    args = ["--dp", "2", "--layer-shard", "o_proj,down_proj", "--prefetch-step", step]
    out = generate_json(path, prompts, *args, "--backend", "none", "--max-new-tokens", "5")
    assert out["token_ids"] == ref
    assert out["prefetch_step"] == 1 if step == "1" else 0 <= out["prefetch_step"] <= 3


def test_generate_with_series_in_host_memory(qwen3):
    """``--offload``: o_proj and down_proj kept in host memory, 2 layers ahead, on one rank; down_proj in host memory
    beside o_proj layer-sharded over two ranks (the ring mixes both sources); transformers' tokens either way."""
    path, prompts, ref = qwen3
    for args in (["--offload", "o_proj,down_proj", "--prefetch-step", "2"],
                 ["--dp", "2", "--layer-shard", "o_proj", "--offload", "down_proj"]):  # fmt: skip
        out = generate_json(path, prompts, *args, "--backend", "none", "--max-new-tokens", "5")
        assert out["token_ids"] == ref, args


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prefetch-step", "1"], "--prefetch-step needs --layer-shard or --offload (which weight series to fetch"),
        (
            ["--dp", "2", "--layer-shard", "o_proj", "--offload", "o_proj,down_proj"],
            "series ['o_proj'] are both layer-sharded (plan.layer_shard) and kept in host memory (plan.offload)",
        ),
        (["--offload", "o_proj,1x"], "Plan.offload: expected series names like 'o_proj,down_proj' or 'layer'"),
        (["--offload", ""], "--offload '': names no weight series; give them (e.g. --offload o_proj,down) or drop it"),
        (["--offload", " , "], "--offload ' , ': names no weight series"),  # once silently ignored
        (
            ["--dp", "2", "--layer-shard", "o_proj", "--prefetch-step", "4"],
            "prefetch_step must be an int with 0 <= k <= num_layers - 1 = 3 (the model has 4 layers, so a ring "
            "of k + 1 slots holds at most all of them), got 4",
        ),
        (["--dp", "2", "--layer-shard", "o_proj,mlp"], "layer_shard: a Qwen3ForCausalLM has no series ['mlp']"),
        (["--dp", "2", "--layer-shard", "q_b_proj"], "a Qwen3ForCausalLM has no series ['q_b_proj']; choose from"),
        (["--dp", "2", "--layer-shard", ","], "expected series names like 'o_proj,down_proj' or 'layer', got ','"),
        (
            ["--dp", "2", "--layer-shard", "o_proj", "--prefetch-step", "soon"],
            "expected a non-negative integer or 'auto', got 'soon'",
        ),
        (
            ["--tp", "2", "--layer-shard", "o_proj", "--layer-shard-axis", "tp"],
            "series 'o_proj' is already sharded over mesh axis 'tp'",
        ),
    ],
)
def test_bad_layer_shard_arguments_are_one_line(qwen3, args, message, capsys):
    refused(
        ["generate", "--model", str(qwen3[0]), *args, "--prompt-ids", "1", "--max-new-tokens", "2"], message, capsys
    )
