"""Gemma 3's sliding layers keep a window-sized ring of keys and values: prompts longer than the window (and one
shorter), right-padded into a prefill bucket past the longest, then decode steps running several windows past it,
against transformers (its Gemma 3 runs a sliding-window cache): every step's logits (1e-4) and the greedy tokens,
eager and (one small case) compiled with inductor. The cache's sizes are counted from the config."""

import pytest
import torch

from ..support.hf_models import hf_greedy, save_tiny_gemma3

WINDOW = 3  # divides neither the prompts nor the steps
PROMPT_LENS = (7, 2, 11)
NEW = 20  # past the longest prompt by more than six windows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_ring")
    hf = save_tiny_gemma3("gemma3", path, 901, sliding_window=WINDOW)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return str(path), hf, prompts


def _steps(model, prompts, new):
    """Each prompt's logits at its last prompt token and at each decode step ``[new, V]``, and the greedy tokens."""
    state = model.new_state(len(prompts))
    logits = [model.prefill(prompts, state)]
    pos = torch.tensor([len(p) for p in prompts])
    for _ in range(new - 1):
        logits.append(model.decode(logits[-1].argmax(-1), pos, state))
        pos = pos + 1
    steps = torch.stack(logits, dim=1).float()  # [B, new, V]
    return steps, steps.argmax(-1).tolist()


def _check(hf, prompts, steps, tokens, new):
    for i, p in enumerate(prompts):
        assert tokens[i] == hf_greedy(hf, p, new), f"prompt {i}: greedy tokens differ"
        seq = torch.tensor([p + tokens[i][:-1]])  # the whole sequence at once: the logits each step saw
        with torch.no_grad():
            ref = hf(seq).logits[0, len(p) - 1 :]
        err = (steps[i] - ref).abs().max().item()
        assert err < 1e-4, f"prompt {i}: step logits differ by {err}"


def _compiled(path, backend, batch, seq, lengths):
    from functional_npu import Mesh, compile_model
    from functional_npu.runtime.loading.checkpoint import load_checkpoint

    mesh = Mesh.abstract({"tp": 1}, 0)
    params = load_checkpoint(path, mesh)
    return compile_model(params, mesh, backend=backend, batch_sizes=[batch], max_seq_len=seq, prefill_lengths=lengths)


def test_prompts_past_the_window_decode_past_it_as_transformers(model_dir):
    """A prefill bucket of 16 (pads past every prompt, some of them landing on ring slots), 20 decode steps."""
    path, hf, prompts = model_dir
    model = _compiled(path, "none", len(prompts), 16 + NEW, [16])
    steps, tokens = _steps(model, prompts, NEW)
    _check(hf, prompts, steps, tokens, NEW)


def test_compiled_ring_is_transformers(model_dir):
    """fullgraph inductor graphs (prefill and decode) over the ring: one prompt past the window, 10 steps."""
    path, hf, prompts = model_dir
    torch._dynamo.reset()
    model = _compiled(path, "inductor", 1, 24, [8])
    steps, tokens = _steps(model, prompts[:1], 10)
    _check(hf, prompts[:1], steps, tokens, 10)


@pytest.mark.parametrize("max_len", [40, WINDOW, 2])
def test_sliding_layers_hold_the_window_full_layers_every_position(model_dir, max_len):
    from functional_npu import Mesh
    from functional_npu.models import init_state
    from functional_npu.runtime.loading.checkpoint import read_config

    cfg = read_config(model_dir[0])
    state = init_state(cfg, Mesh.abstract({"tp": 1}, 0), 2, max_len)
    kinds = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]  # the saved model's
    want = [(2, 2, min(WINDOW, max_len) if k == "sliding_attention" else max_len, 32) for k in kinds]
    assert [tuple(k.shape) for k, _ in state.kv] == want
    assert [tuple(v.shape) for _, v in state.kv] == want
