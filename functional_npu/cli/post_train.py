"""``demo --post-train``: one round of the post-training loop on the embedded model, on 2 local gloo ranks.

Both plans run on the same two ranks (mesh ``{"dp": 2, "tp": 1}``): inference is tensor parallel over ``dp``
(``Plan(tp="dp")``), compiled with inductor; training is data parallel with every layer's weights layer-sharded
over ``dp`` (each rank holds half the layers, as ZeRO-3 would), the train step compiled whole. The round:

1. sample ``K`` completions of each prompt with the compiled inference model, keeping each token's
   log-probability from the logits it was drawn from;
2. score them with a toy reward (the share of completion tokens in the lowest quarter of the vocabulary) and
   turn the rewards into GRPO advantages within each prompt's group;
3. measure how far the training forward's log-probabilities of the same tokens are from the rollout's, under the
   inference plan and under the training plan: both plans run in the batch-invariant mode
   (``Plan(invariant="batch")``, :mod:`functional_npu.models.batch_invariant`), where they are equal bit for bit;
   the same round's rollout without the mode (eager, the same rows) gives the figure beside it;
4. take compiled train steps on the GRPO loss (each rank on its half of the rollouts);
5. reshard the updated params from the training plan to the inference plan (one planned exchange), swap them
   into the compiled model (no recompile), sample again with the same seed, and score.

Reported: the reward before and after, the step time, the reshard's bytes against the lower bound, and the
log-probability gaps.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..core.collectives import all_reduce
from ..parallel.plan import Plan
from ..runtime.launch import LocalWorld, RankContext
from ..runtime.loading.save import save_checkpoint
from .demo import DEMO_MODEL, SMALL_CONFIG
from .errors import WORLD_ERRORS, world_failed
from .scratch import scratch_dir

INFERENCE = Plan(tp="dp", invariant="batch")
TRAINING = Plan(layer_shard="layer", prefetch_step=1, invariant="batch")
PROMPTS = [[11, 42, 7, 300, 5], [9, 8, 7, 6, 5], [256, 17, 3, 3, 90], [1, 2, 3, 4, 5]]
GROUP = 4  # completions per prompt
NEW = 12
LR = 3e-3
STEPS = 2  # train steps on the round's rollouts (the second timed; the first compiles)


def reward(completion: list[int], vocab: int) -> float:
    """The toy reward: the share of completion tokens in the lowest quarter of the vocabulary."""
    return sum(t < vocab // 4 for t in completion) / len(completion)


def post_train_on_rank(ctx: RankContext, model_dir: str, seed: int) -> dict[str, Any]:
    """One round of the loop on this rank (see the module docstring); returns its measurements."""
    from ..runtime.loading.checkpoint import load_checkpoint
    from ..runtime.serving.compile import compile_model
    from ..runtime.training.grad import token_logprobs
    from ..runtime.training.optim import AdamW
    from ..runtime.training.policy import group_advantages, grpo_loss, logprob_gap, policy_batch
    from ..runtime.training.train_step import compile_train_step
    from ..runtime.training.weight_sync import plan_params_reshard, reshard_params

    mesh = ctx.mesh({"dp": 2, "tp": 1})
    rows = [p for p in PROMPTS for _ in range(GROUP)]
    vocab = SMALL_CONFIG.vocab_size
    model = compile_model(
        load_checkpoint(model_dir, mesh, INFERENCE), mesh, backend="inductor", batch_sizes=[len(rows)],
        max_seq_len=64, prefill_lengths=[len(PROMPTS[0])],
    )  # fmt: skip
    t0 = time.perf_counter()
    before = model.sample(rows, NEW, seed=seed)
    rollout_s = time.perf_counter() - t0
    rewards = torch.tensor([reward(c, vocab) for c in before.tokens]).reshape(len(PROMPTS), GROUP)
    advantages = group_advantages(rewards).flatten().tolist()
    everything = policy_batch(rows, before, advantages)
    same_plan = logprob_gap(token_logprobs(model.params, everything.tokens, mesh), everything)
    off = _without_the_mode(model_dir, mesh, rows, seed)

    params = load_checkpoint(model_dir, mesh, TRAINING)
    half = slice(mesh.axis_index("dp") * len(rows) // 2, (mesh.axis_index("dp") + 1) * len(rows) // 2)
    mine = policy_batch(rows[half], type(before)(before.tokens[half], before.logprobs[half]), advantages[half])
    gap = logprob_gap(token_logprobs(params, mine.tokens, mesh), mine)
    train_plan = all_reduce(torch.tensor(gap), mesh, "dp", "max").item()

    t0 = time.perf_counter()
    step = compile_train_step(grpo_loss, AdamW(lr=LR, weight_decay=0.0), params, mesh, backend="inductor")
    state, times, losses = step.init(params), [], []
    for _ in range(STEPS):
        t1 = time.perf_counter()
        params, state, stats = step(params, state, mine)
        times.append(time.perf_counter() - t1)
        losses.append(stats.loss)
    first_step_s = time.perf_counter() - t0

    exchange = plan_params_reshard(params, INFERENCE, mesh)
    t0 = time.perf_counter()
    served = model.with_params(reshard_params(params, INFERENCE, mesh, exchange=exchange))
    reshard_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    after = served.sample(rows, NEW, seed=seed)
    return {
        "reward_before": sum(reward(c, vocab) for c in before.tokens) / len(rows),
        "reward_after": sum(reward(c, vocab) for c in after.tokens) / len(rows),
        "gap_same_plan": same_plan,
        "gap_train_plan": train_plan,
        "gap_off_same_plan": off[0],
        "gap_off_train_plan": off[1],
        "losses": losses,
        "step_s": times[-1],
        "compile_and_first_step_s": first_step_s - sum(times[1:]),
        "reshard_s": reshard_s,
        "received": exchange.traffic[mesh.rank].received,
        "lower_bound": exchange.traffic[mesh.rank].lower_bound,
        "rollout_s": rollout_s,
        "rollout_after_s": time.perf_counter() - t0,
    }


def _without_the_mode(model_dir: str, mesh: Any, rows: list[list[int]], seed: int) -> tuple[float, float]:
    """The round's log-probability gaps without the invariant mode, under the inference plan and under the training
    plan: a rollout of the same rows by the plain Python forward (eager), against each plan's training forward."""
    import dataclasses

    from ..runtime.loading.checkpoint import load_checkpoint
    from ..runtime.serving.compile import compile_model
    from ..runtime.training.grad import token_logprobs
    from ..runtime.training.policy import logprob_gap, policy_batch

    inference, training = (dataclasses.replace(p, invariant=False) for p in (INFERENCE, TRAINING))
    model = compile_model(
        load_checkpoint(model_dir, mesh, inference), mesh, backend="none", batch_sizes=[len(rows)], max_seq_len=64,
        prefill_lengths=[len(PROMPTS[0])],
    )  # fmt: skip
    samples = model.sample(rows, NEW, seed=seed)
    batch = policy_batch(rows, samples, [0.0] * len(rows))
    same = logprob_gap(token_logprobs(model.params, batch.tokens, mesh), batch)
    other = logprob_gap(token_logprobs(load_checkpoint(model_dir, mesh, training), batch.tokens, mesh), batch)
    return same, other


def run_post_train(*, timeout: float = 600.0, seed: int = 0) -> int:
    """Print the round's figures; return 0 when the reshard moved exactly its lower bound and the rollout's and
    the training forward's log-probabilities are equal (the invariant mode: a difference of exactly 0.0)."""
    cfg = SMALL_CONFIG
    print(
        f"functional-npu demo --post-train: embedded {cfg.architecture}-style model, 2 local ranks; inference "
        f"tp over dp (compiled), training dp with every layer layer-sharded (compiled step), both in the invariant "
        f"mode; {len(PROMPTS)} prompts x {GROUP} completions of {NEW} tokens, GRPO loss, AdamW lr {LR}, {STEPS} steps"
    )
    with scratch_dir("post-train") as tmp:
        save_checkpoint(DEMO_MODEL.init_params(cfg, seed=0), tmp)
        try:
            with LocalWorld(2, timeout=timeout, remove_when_orphaned=(tmp,)) as world:
                results = world.run(post_train_on_rank, tmp, seed)
        except WORLD_ERRORS as e:
            return world_failed(e)
    r = results[0]
    print("\n| figure | value |\n|---|---|")
    print(f"| reward before -> after (same seed) | {r['reward_before']:.3f} -> {r['reward_after']:.3f} |")
    print(f"| GRPO loss, step 1 -> step {STEPS} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")
    print(f"| train step (compiled, warm) | {r['step_s'] * 1e3:.1f} ms |")
    print(f"| compile + first step | {r['compile_and_first_step_s']:.1f} s |")
    moved = ", ".join(f"rank {i}: {x['received']} of {x['lower_bound']}" for i, x in enumerate(results))
    print(f"| reshard to the inference plan: bytes received of the lower bound | {moved} |")
    print(f"| reshard + swap into the compiled model | {r['reshard_s'] * 1e3:.1f} ms |")
    print(f"| rollout before / after (after: no recompile) | {r['rollout_s']:.2f} s / {r['rollout_after_s']:.2f} s |")
    print(
        f"| log-prob mismatch, rollout vs training forward, same plan / training plan (invariant mode) | "
        f"{r['gap_same_plan']} / {r['gap_train_plan']} |"
    )
    print(
        f"| the same without the invariant mode (eager rollout of the same rows) | {r['gap_off_same_plan']:.2e} / "
        f"{r['gap_off_train_plan']:.2e} |"
    )
    ok = all(x["received"] == x["lower_bound"] for x in results)
    ok &= r["gap_same_plan"] == 0.0 and r["gap_train_plan"] == 0.0
    print("\ndemo --post-train: OK" if ok else "\ndemo --post-train: FAILED")
    return 0 if ok else 1
