"""Rank functions for the invariant mode's tests (tests/runtime/test_invariant.py): a rollout sampled by a model of
this rank's plan, then the training forward over the same tokens, on one or more ranks."""

import torch

# prompts of other lengths beside each other: batches 1, 3 and 8
PROMPTS = {
    1: [[7, 3, 9, 4, 11]],
    3: [[5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6, 7]],
    8: [[5, 6, 7, 8], [3], [1, 2, 3, 4, 5, 6, 7], [9, 10], [7, 3, 9, 4, 11], [12] * 6, [2, 4], [8, 8, 1, 30, 5]],
}
NEW = 5
MAX_SEQ = 16


def model_for(ctx, model_dir: str, tp: int, dtype: str, invariant: bool, backend: str, sizes=(1, 4, 8), **plan):
    """This rank's compiled model of ``model_dir`` (any family) under ``Plan(invariant=..., **plan)`` over
    ``{"tp": tp}``."""
    from functional_npu import Mesh, Plan, compile_model, load_checkpoint

    mesh = ctx.mesh({"tp": tp}) if ctx is not None else Mesh.abstract({"tp": 1}, 0)
    plan = Plan(invariant=invariant, **plan)
    params = load_checkpoint(model_dir, mesh, plan, dtype=getattr(torch, dtype))
    lengths = [8]
    return compile_model(
        params, mesh, backend=backend, batch_sizes=list(sizes), max_seq_len=MAX_SEQ, prefill_lengths=lengths
    ), mesh


def rollout_gaps(model, mesh, prompt_sets, seed: int = 4) -> list[float]:
    """For each set of prompts: the largest |rollout log-prob - training forward's| over the completion tokens."""
    from functional_npu.runtime.training.grad import token_logprobs
    from functional_npu.runtime.training.policy import logprob_gap, policy_batch

    gaps = []
    for prompts in prompt_sets:
        s = model.sample(prompts, NEW, seed=seed)
        batch = policy_batch(prompts, s, [0.0] * len(prompts), dtype=torch.float32)
        gaps.append(logprob_gap(token_logprobs(model.params, batch.tokens, mesh), batch))
    return gaps


def gaps_on_rank(
    ctx, model_dir: str, tp: int, dtype: str, invariant: bool, backend: str = "none", **plan
) -> list[float]:
    """:func:`rollout_gaps` at batches 1, 3 and 8 on this rank (``plan``: more of the plan's fields)."""
    model, mesh = model_for(ctx, model_dir, tp, dtype, invariant, backend, **plan)
    return rollout_gaps(model, mesh, [PROMPTS[b] for b in (1, 3, 8)])


def mismatch(params, batch, mesh):
    """A loss that is the largest |training forward's log-prob - rollout's| over the completion tokens: exactly 0.0
    when they agree bit for bit."""
    from functional_npu.runtime.training.grad import token_logprobs

    return ((token_logprobs(params, batch.tokens, mesh) - batch.old_logprobs).abs() * batch.mask).max()


def compiled_step_mismatch(ctx, model_dir: str, tp: int, dtype: str, invariant: bool, train: bool = True) -> dict:
    """A rollout of the inductor-compiled model at batch 3 and (``train``) the training forward inside a train step
    compiled with inductor (forward, backward and update in one graph): the rollout's gap against the eager training
    forward, and the step's loss (:func:`mismatch`)."""
    from functional_npu.runtime.training.optim import AdamW
    from functional_npu.runtime.training.policy import policy_batch
    from functional_npu.runtime.training.train_step import compile_train_step

    model, mesh = model_for(ctx, model_dir, tp, dtype, invariant, "inductor", sizes=(4,))
    prompts = PROMPTS[3]
    s = model.sample(prompts, NEW, seed=4)
    batch = policy_batch(prompts, s, [1.0, -1.0, 0.5], dtype=torch.float32)
    gap = rollout_gaps(model, mesh, [prompts])[0]
    if not train:
        return {"gap": gap}
    step = compile_train_step(mismatch, AdamW(lr=1e-3), model.params, mesh, backend="inductor")
    _, _, stats = step(model.params, step.init(model.params), batch)
    return {"gap": gap, "step_loss": stats.loss}


def training_logprobs(ctx, model_dir: str, axes: dict, plan_fields: dict, dtype: str, tokens) -> torch.Tensor:
    """The training forward's log-probabilities of ``tokens`` under ``Plan(**plan_fields)`` (invariant: portable
    unless it says) over ``axes`` on this rank."""
    from functional_npu import Plan, load_checkpoint
    from functional_npu.runtime.training.grad import token_logprobs

    mesh = ctx.mesh(axes)
    params = load_checkpoint(model_dir, mesh, Plan(**({"invariant": True} | plan_fields)), dtype=getattr(torch, dtype))
    return token_logprobs(params, tokens, mesh)


def dp_logits(ctx, model_dir: str, expert_axes, rows: int, mode: str = "portable") -> torch.Tensor:
    """The invariant training forward's logits on a dp 2 x tp 2 mesh under ``expert_axes``, each dp rank over its own
    ``rows`` random sequences of 9 tokens."""
    from functional_npu import Plan, load_checkpoint
    from functional_npu.runtime.training.grad import logits

    mesh = ctx.mesh({"dp": 2, "tp": 2})
    params = load_checkpoint(model_dir, mesh, Plan(invariant=mode, expert_axes=tuple(expert_axes)))
    g = torch.Generator().manual_seed(7 + mesh.axis_index("dp"))
    return logits(params, torch.randint(0, 128, (rows, 9), generator=g), mesh)
