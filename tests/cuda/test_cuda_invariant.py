"""The invariant mode on a GPU: a rollout sampled on the device (prompts of other lengths beside each other, batches 1,
3 and 8) has the training forward's log-probabilities bit for bit, in float32 and bfloat16; and the device's bits are
the CPU's (every reduction is one fixed expression of IEEE adds and multiplies, which a CUDA kernel rounds as the
CPU does), so a rollout on the GPU and training on the CPU agree exactly. The control: without the mode the rollout
and the training forward differ on the device too, in float32. In bfloat16 this tiny model's two forwards happened to
agree without the mode as well on an H200 (the same cuBLAS kernels for both, rounded to bfloat16), so there the
control is the CPU's (tests/runtime/test_invariant.py).

Run by ``python -m benchmarks gpu``; skipped where CUDA is absent, as on CI.
"""

from __future__ import annotations

import pytest
import torch

from functional_npu import Mesh, Plan, compile_model, load_checkpoint
from functional_npu.runtime.training.grad import token_logprobs
from functional_npu.runtime.training.policy import logprob_gap, policy_batch

from ..support.hf_models import save_tiny
from ..support.invariant_workers import MAX_SEQ, NEW, PROMPTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (python -m benchmarks gpu)")

ONE = Mesh.abstract({"tp": 1}, 0)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-invariant-cuda")
    save_tiny("qwen3", path, 31)
    return str(path)


def _model(path: str, dtype: torch.dtype, invariant: bool):
    params = load_checkpoint(path, ONE, Plan(invariant=invariant), dtype=dtype, device="cuda")
    return compile_model(
        params, ONE, backend="aot_eager", batch_sizes=[1, 4, 8], max_seq_len=MAX_SEQ, prefill_lengths=[8]
    )


def _gaps(model) -> list[float]:
    out = []
    for b in (1, 3, 8):
        prompts = PROMPTS[b]
        s = model.sample(prompts, NEW, seed=4)
        batch = policy_batch(prompts, s, [0.0] * len(prompts), device="cuda")
        out.append(logprob_gap(token_logprobs(model.params, batch.tokens, ONE), batch))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rollout_on_the_gpu_has_the_training_forwards_bits(qwen3, dtype):
    model = _model(qwen3, dtype, True)
    assert model.params["embed"].device.type == "cuda"
    assert _gaps(model) == [0.0, 0.0, 0.0]


def test_without_the_mode_the_forwards_differ_on_the_gpu(qwen3):
    assert max(_gaps(_model(qwen3, torch.float32, False))) > 0.0, "the control: without the mode they must differ"


def test_the_gpus_bits_are_the_cpus(qwen3):
    """The training forward of the same sampled tokens on the GPU and on the CPU: equal log-probabilities."""
    model = _model(qwen3, torch.float32, True)
    s = model.sample(PROMPTS[8], NEW, seed=4)
    batch = policy_batch(PROMPTS[8], s, [0.0] * 8)
    cpu = token_logprobs(load_checkpoint(qwen3, ONE, Plan(invariant=True)), batch.tokens, ONE)
    gpu = token_logprobs(model.params, batch.tokens.cuda(), ONE).cpu()
    assert torch.equal(cpu, gpu), float((cpu - gpu).abs().max())
    assert logprob_gap(cpu, batch) == 0.0  # the GPU's rollout log-probs are the CPU's training forward's
