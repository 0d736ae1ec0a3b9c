"""``generate --ep``: an MoE model with its experts over the flattened dp x tp ranks, against transformers;
unsupported combinations are one clear line and exit code 2."""

import pytest

from ..support.cli import PROMPTS, generate_json, refused
from ..support.hf_models import hf_greedy, save_tiny, save_tiny_moe


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    hf = save_tiny_moe("mixtral", path, 7)
    return path, PROMPTS, [hf_greedy(hf, p, 6) for p in PROMPTS]


def test_generate_ep2_over_dp_in_lockstep(mixtral):
    """dp 2 with 3 prompts: the ranks hold 2 and 1 prompts of different lengths and still exchange tokens every step."""
    path, prompts, ref = mixtral
    assert (
        generate_json(path, prompts, "--dp", "2", "--ep", "2", "--backend", "eager", "--max-new-tokens", "6")[
            "token_ids"
        ]
        == ref
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--dp", "2", "--ep", "3"],
            "--ep 3: the expert group is the flattened dp x tp ranks, "
            "so --ep must be 1 (experts replicated) or --dp 2 x --tp 1 = 2",
        ),
        (
            ["--dp", "3", "--ep", "3"],
            "cannot shard this MixtralForCausalLM config: specs['layers.0.experts_gate_up'] "
            "shards dim 0 (size 8) over mesh axis 'dp,tp' (size 3)",
        ),
    ],
)
def test_unsupported_expert_parallelism_is_one_line(mixtral, args, message, capsys):
    refused(
        ["generate", "--model", str(mixtral[0]), *args, "--prompt-ids", "1", "--max-new-tokens", "2"], message, capsys
    )


def test_ep_on_a_dense_model(tmp_path, capsys):
    save_tiny("qwen2", tmp_path, 1)
    refused(
        ["generate", "--model", str(tmp_path), "--tp", "2", "--ep", "2", "--prompt-ids", "1", "--max-new-tokens", "2"],
        "needs a mixture-of-experts model, but this is a Qwen2ForCausalLM",
        capsys,
    )
