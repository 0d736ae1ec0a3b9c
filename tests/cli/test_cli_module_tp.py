"""``generate --otp / --lmhead-tp / --embed-tp / --mlp-tp``: module TP over dp ranks from the command line, and
its refusals (one line, exit 2, before any rank starts)."""

import pytest

from ..support.cli import PROMPTS, generate_json, refused
from ..support.hf_models import hf_greedy, save_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    hf = save_tiny("qwen3", path, 5)
    return path, [hf_greedy(hf, p, 6) for p in PROMPTS]


@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory):
    """127 vocabulary rows: no vocab-parallel split over 2 ranks."""
    path = tmp_path_factory.mktemp("odd")
    save_tiny("qwen3", path, 5, vocab_size=127)
    return path


def test_every_module_tp_over_dp2_generates_transformers_tokens(model):
    path, want = model
    flags = ["--otp", "2", "--lmhead-tp", "2", "--embed-tp", "2", "--mlp-tp", "2"]
    out = generate_json(path, PROMPTS, "--dp", "2", *flags, "--max-new-tokens", "6", "--backend", "none")
    assert out["token_ids"] == want


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dp", "4", "--otp", "3"], "--otp 3: the o_proj TP group is a chunk of dp ranks, so it must divide --dp 4"),
        (["--dp", "2", "--mlp-tp", "4"], "--mlp-tp 4: the mlp TP group is a chunk of dp ranks, so it must divide"),
        (["--dp", "6", "--otp", "2", "--embed-tp", "3"], "sizes 2 and 3 (o_proj, embed) do not nest"),
        (["--dp", "2", "--otp", "2", "--ep", "2"], "experts and module TP over the same dp ranks is not supported"),
    ],
)
def test_bad_module_tp_sizes_are_refused(model, args, message, capsys):
    argv = ["generate", "--model", str(model[0]), "--prompt-ids", "1,2", "--max-new-tokens", "2", *args]
    refused(argv, message, capsys)


def test_a_vocab_that_does_not_split_names_the_module_and_sizes(odd_vocab, capsys):
    argv = ["generate", "--model", str(odd_vocab), "--dp", "2", "--lmhead-tp", "2", "--prompt-ids", "1"]
    refused([*argv, "--max-new-tokens", "2"], "specs['lm_head']", capsys)
