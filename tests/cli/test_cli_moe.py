"""``generate --ep``: an MoE model with its experts over the flattened dp x tp ranks, against transformers;
unsupported combinations are one clear line and exit code 2."""

import json

import pytest
import torch

from functional_npu.cli.main import main

from ..support.hf_models import save_tiny, save_tiny_moe
from .test_cli import _cli


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    hf = save_tiny_moe("mixtral", path, 7)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [100, 3]]
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(p):].tolist() for p in prompts]
    return path, prompts, ref


def test_generate_ep2_over_dp_in_lockstep(mixtral):
    """dp 2 with 3 prompts: the ranks hold 2 and 1 prompts of different lengths and still exchange tokens every step."""
    path, prompts, ref = mixtral
    args = ["generate", "--model", str(path), "--dp", "2", "--ep", "2", "--backend", "eager", "--max-new-tokens", "6", "--json"]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    out = _cli(*args)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["token_ids"] == ref


@pytest.mark.parametrize("args, message", [
    (["--dp", "2", "--ep", "3"], "--ep 3: the expert group is the flattened dp x tp ranks, so --ep must be 1 (experts replicated) or --dp 2 x --tp 1 = 2"),
    (["--dp", "3", "--ep", "3"], "cannot shard this MixtralForCausalLM config: specs['layers.0.experts_gate_up'] shards dim 0 (size 8) over mesh axis 'dp,tp' (size 3)"),
])
def test_unsupported_expert_parallelism_is_one_line(mixtral, args, message, capsys):
    _refused(["generate", "--model", str(mixtral[0]), *args, "--prompt-ids", "1", "--max-new-tokens", "2"], message, capsys)


def test_ep_on_a_dense_model(tmp_path, capsys):
    save_tiny("qwen2", tmp_path, 1)
    _refused(["generate", "--model", str(tmp_path), "--tp", "2", "--ep", "2", "--prompt-ids", "1", "--max-new-tokens", "2"],
             "needs a mixture-of-experts model, but this is a Qwen2ForCausalLM", capsys)


def _refused(argv, message, capsys):
    """The CLI in this process (argument checks run before any rank starts): exit 2, one error line."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1
