"""Train-step jobs: transformers' own training steps as the reference, and the compiled step on each rank."""

import torch

from .hf_models import causal_lm_loss, float64_norms

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)


def hf_train(model, batches, steps: int, path) -> list[tuple[float, float]]:
    """``steps`` steps of transformers' causal-LM loss over ``batches`` (all at once) in float64 with
    ``clip_grad_norm_`` and ``torch.optim.AdamW``; the trained model saved to ``path``. Returns (loss, grad norm
    before clipping) per step."""
    model = float64_norms(model.double()).train()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    hp = dict(ADAMW)
    max_norm = hp.pop("max_grad_norm")
    opt = torch.optim.AdamW(model.parameters(), **hp)
    batch, out = torch.cat(batches), []
    for _ in range(steps):
        opt.zero_grad()
        loss = causal_lm_loss(model, batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        out.append((loss.item(), norm.item()))
    model.save_pretrained(path)
    return out


def train_errors(ctx, model_dir, trained_dir, axes, plan_fields, batches, steps, backend, *, module_tp=None, **change):
    """``steps`` compiled steps of :func:`lm_loss` on this rank's batch (its data-parallel index), then each
    trained leaf's largest difference from ``trained_dir`` loaded for this rank with the same plan. Returns the
    per-step (loss, grad norm), the errors by path and the state's step count. ``change``: AdamW fields other
    than the reference's."""
    from functional_npu import flatten_with_paths, load_checkpoint
    from functional_npu.runtime.training.grad import lm_loss
    from functional_npu.runtime.training.optim import AdamW
    from functional_npu.runtime.training.train_step import compile_train_step

    from .grad_workers import data_index, plan_and_mesh

    plan, mesh = plan_and_mesh(ctx, axes, plan_fields, module_tp)
    params = load_checkpoint(model_dir, mesh, plan, dtype=torch.float64)
    want = dict(flatten_with_paths(load_checkpoint(trained_dir, mesh, plan, dtype=torch.float64)))
    step = compile_train_step(lm_loss, AdamW(**(ADAMW | change)), params, mesh, backend=backend)
    state, stats = step.init(params), []
    batch = batches[data_index(mesh, plan)]
    for _ in range(steps):
        params, state, s = step(params, state, batch)
        stats.append(tuple(s))
    errors = {p: (x - want[p]).abs().max().item() for p, x in flatten_with_paths(params) if p in step.split.leaves}
    return {"stats": stats, "errors": errors, "step": int(state.step)}
