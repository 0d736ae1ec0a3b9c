"""Rank jobs for gradient tests: this rank's loss and gradient shards under a plan, checked against the
gradient transformers computed, saved as a checkpoint and read back for this rank by ``load_checkpoint``."""

import torch


def data_index(mesh, plan) -> int:
    """This rank's data-parallel index: its index over every axis but tp (mesh order)."""
    others = tuple(a for a in mesh.axis_names if a != plan.tp)
    return mesh.axis_index(others) if others else 0


def plan_and_mesh(ctx, axes: dict, plan_fields: dict, module_tp: dict | None):
    """The plan and this rank's mesh: ``axes`` as given, or with ``dp`` split for ``module_tp`` sizes."""
    from functional_npu import Mesh, Plan, split_dp

    fields = dict(plan_fields)
    if module_tp:
        axes, fields["module_tp"] = split_dp(axes, module_tp)
    mesh = ctx.mesh(axes) if ctx is not None else Mesh.abstract(axes, 0)
    return Plan(**fields), mesh


def grad_errors(
    ctx, model_dir: str, grad_dir: str, axes: dict, plan_fields: dict, batches, *, module_tp=None, drop_sums=False
):
    """Load ``model_dir`` in float64 for the plan; this rank takes ``batches[data index]``. Returns the mean loss,
    and per gradient leaf the largest difference from ``grad_dir`` (transformers' gradient of the mean loss over
    every batch, saved with ``save_pretrained``) loaded for this rank with the same plan. ``drop_sums``: skip
    the replica sums (a broken gradient, for the test that the check can fail)."""
    from functional_npu import flatten_with_paths, load_checkpoint
    from functional_npu.core.replica_sum import ReplicaSum
    from functional_npu.runtime.grad import differentiable, grad_step, lm_loss

    plan, mesh = plan_and_mesh(ctx, axes, plan_fields, module_tp)
    params = load_checkpoint(model_dir, mesh, plan, dtype=torch.float64)
    want = dict(flatten_with_paths(load_checkpoint(grad_dir, mesh, plan, dtype=torch.float64)))
    split = differentiable(params, mesh)
    if drop_sums:
        split.sums = {p: ReplicaSum(()) for p in split.sums}
    if not mesh.is_abstract:
        mesh.init_groups()
    loss, grads = grad_step(lm_loss, split, batches[data_index(mesh, plan)], mesh)
    errors = {p: (g - want[p]).abs().max().item() for p, g in flatten_with_paths(grads) if isinstance(g, torch.Tensor)}
    scale = max(want[p].abs().max().item() for p in errors)
    return {"loss": loss.item(), "errors": errors, "scale": scale, "none": sorted(set(want) - set(errors))}
