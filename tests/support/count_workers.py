"""Rank jobs for the step model's counted-bytes tests: one forward step of a plan, its collectives counted as they are
dispatched (:class:`benchmarks.counting.ReceivedBytes`), nothing taken from the step model."""

import torch


def counted_step(ctx, cfg, axes: dict, plan_fields: dict, batch: int, length: int, context: int) -> dict:
    """This rank's bytes received and collectives per op for one forward of ``batch`` sequences of ``length`` new
    tokens (decode: 1) at ``context`` cached positions, the params of ``cfg`` sharded by ``Plan(**plan_fields)`` over
    ``axes``; every dp rank holds ``batch / dp`` of the sequences."""
    from benchmarks.counting import ReceivedBytes
    from functional_npu import Plan, split_dp
    from functional_npu.core import shard
    from functional_npu.models import family_of, forward, init_state
    from functional_npu.parallel.module_tp import dp_axes
    from functional_npu.placement import place

    module_tp = plan_fields.pop("module_tp", None)
    if module_tp:
        axes, split = split_dp(axes, module_tp)
        plan_fields["module_tp"] = split
    mesh = ctx.mesh(axes)
    plan = Plan(**plan_fields)
    model = family_of(cfg)
    params = shard(model.init_params(cfg, seed=0), model.param_specs(cfg, plan), mesh, placement=place(cfg, mesh, plan))
    plan = params.placement.plan
    seqs = batch // mesh.axis_size(dp_axes(mesh, plan.tp))
    state = init_state(cfg, mesh, seqs, context + length, params["embed"].dtype, plan=plan)
    tokens = torch.ones(seqs, length, dtype=torch.long)
    positions = torch.arange(context, context + length).expand(seqs, length)
    with torch.no_grad(), ReceivedBytes() as counted:
        forward(params, tokens, positions, state, mesh, plan=plan, attention="math")
    return {"received": counted.received, "calls": dict(counted.calls), "by_op": dict(counted.by_op)}
