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
    from functional_npu.runtime.training.grad import differentiable, grad_step, lm_loss

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


def replica_grads(ctx, axes: dict, leaves, seed: int):
    """Random leaves (``(shape, _, layout)``, float64 here) sharded on this rank, and a loss every rank computes
    alike: ``sum(sin(W) * C)`` over the full leaves, each rank adding its elements once per holder weighted by one
    over the holder count (counted by sharding an index tensor to every coordinate), then ``all_reduce``. Its
    gradient is ``cos(W) * C``. Returns, per leaf, whether the shares summed by ``sum_replicas`` equal that
    gradient sharded for this rank, and whether the unsummed shares already did."""
    from functional_npu import all_reduce, shard
    from functional_npu.core.replica_sum import replica_plan, sum_replicas

    from .strategies import all_coordinates, make_tensor

    mesh = ctx.mesh(axes)
    full = {f"w{i}": make_tensor(shape, torch.float64, seed + i) for i, (shape, _, _) in enumerate(leaves)}
    coef = {f"w{i}": make_tensor(shape, torch.float64, seed + 50 + i) for i, (shape, _, _) in enumerate(leaves)}
    specs = {f"w{i}": layout for i, (_, _, layout) in enumerate(leaves)}
    index = {p: torch.arange(w.numel(), dtype=torch.float64).reshape(w.shape) for p, w in full.items()}
    counts = {p: torch.zeros(w.numel(), dtype=torch.float64) for p, w in full.items()}
    for at in all_coordinates(mesh):
        for p, idx in shard(index, specs, at).items():
            counts[p].index_add_(0, idx.long().flatten(), torch.ones(idx.numel(), dtype=torch.float64))
    mine = shard(index, specs, mesh)
    weight = {p: 1.0 / counts[p][mine[p].long()] for p in full}
    local, c_local = shard(full, specs, mesh), shard(coef, specs, mesh)

    def loss(ws):
        part = sum((ws[p].sin() * c_local[p] * weight[p]).sum() for p in ws)
        return all_reduce(part, mesh, tuple(mesh.axis_names)) / mesh.size  # every rank's loss, seeded 1 / world

    shares = torch.func.grad(loss)(local)
    want = shard({p: full[p].cos() * coef[p] for p in full}, specs, mesh)
    out = {}
    for p, g in shares.items():
        summed = sum_replicas(g, replica_plan(specs[p], full[p].shape, mesh.shape), mesh)
        out[p] = (torch.allclose(summed, want[p], rtol=0, atol=1e-12), torch.allclose(g, want[p], rtol=0, atol=1e-12))
    return out
