"""Rank jobs for gradient tests: this rank's loss and gradient shards under a plan, with their layouts."""

import torch


def grad_shards(ctx, model_dir: str, axes: dict, plan_fields: dict, tokens, *, dtype=torch.float64):
    """Load ``model_dir`` for ``Plan(**plan_fields)`` on a mesh of ``axes``; this rank's rows of ``tokens`` are
    the ones its data-parallel index picks (``tokens`` is a list per data-parallel group, or one batch every
    rank shares). Returns the mean loss, this rank's loss, its gradient shards (tensors by path), the layouts
    and the mesh shape and coordinate."""
    from functional_npu import Plan, flatten_with_paths, load_checkpoint
    from functional_npu.runtime.grad import lm_loss, value_and_grad
    from functional_npu.runtime.plan import check_plan

    mesh = ctx.mesh(axes)
    plan = Plan(**plan_fields)
    params = load_checkpoint(model_dir, mesh, plan, dtype=dtype)
    batch = tokens[_data_index(mesh, plan)] if isinstance(tokens, list) else tokens
    mine = lm_loss(params, batch, mesh).item()
    loss, grads = value_and_grad(lm_loss)(params, batch, mesh)
    _, layouts = check_plan(params["config"], mesh, plan)
    shards = {p: g for p, g in flatten_with_paths(grads) if isinstance(g, torch.Tensor)}
    return {"loss": loss.item(), "mine": mine, "grads": shards, "layouts": layouts, "coordinate": mesh.coordinate}


def _data_index(mesh, plan) -> int:
    """This rank's data-parallel index: its index over every axis but tp."""
    others = tuple(a for a in mesh.axis_names if a != plan.tp)
    return mesh.axis_index(others) if others else 0
