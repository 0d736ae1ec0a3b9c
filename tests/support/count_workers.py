"""Rank jobs for the step model's counted-bytes tests: one forward step of a plan, its collectives counted as they are
dispatched (:class:`benchmarks.counting.ReceivedBytes`), nothing taken from the step model."""

import torch


def counted_step(ctx, cfg, axes: dict, plan_fields: dict, batch: int, length: int, context: int) -> dict:
    """This rank's bytes received and collectives per op for one forward of ``batch`` sequences of ``length`` new
    tokens (decode: 1) at ``context`` cached positions, the params of ``cfg`` sharded by ``Plan(**plan_fields)`` over
    ``axes``; every dp rank holds ``batch / dp`` of the sequences. A prefill takes the logits of each sequence's last
    token alone, as ``compile_model``'s prefill and the engine's chunks do."""
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
    last = torch.full((seqs,), length - 1) if length > 1 else None  # as the runtime's prefill: the last token's logits
    with torch.no_grad(), ReceivedBytes() as counted:
        forward(params, tokens, positions, state, mesh, last, plan=plan, attention="math")
    return {"received": counted.received, "calls": dict(counted.calls), "by_op": dict(counted.by_op)}


def counted_ring_step(ctx, cfg, dp: int, series: str | None, offload: str, k: int, batch: int, steps: int) -> dict:
    """This rank's prefetch ring transfers over ``steps`` decode steps (the ring started as the model starts it, then
    carried): ``cfg`` with ``series`` layer-sharded over ``dp`` ranks and ``offload`` kept in host memory, fetched
    ``k`` layers ahead. Each ``functional_npu::broadcast_into`` is counted as it is dispatched: a broadcast over a
    group (its calls, the bytes this rank receives: the slot unless it is the source) or a copy into a slot from a
    local source (its calls and bytes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from functional_npu import Plan
    from functional_npu.core import shard
    from functional_npu.models import family_of, forward, init_state
    from functional_npu.parallel import (
        host_specs,
        layer_shard,
        prefetch,
        ring_of,
        series_specs,
        stack_host,
        stack_series,
    )
    from functional_npu.placement import place, resolved

    counts = {"broadcast_calls": 0, "broadcast_received": 0, "copy_calls": 0, "copy_bytes": 0}

    class Transfers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
            if str(func.overloadpacket) == "functional_npu.broadcast_into":
                slot, parts, _after, src, group, size = args
                nbytes = slot.numel() * slot.element_size()
                if size > 1:
                    counts["broadcast_calls"] += 1
                    counts["broadcast_received"] += 0 if parts else nbytes
                elif parts:
                    counts["copy_calls"] += 1
                    counts["copy_bytes"] += nbytes
            return func(*args, **(kwargs or {}))

    mesh = ctx.mesh({"dp": dp, "tp": 1})
    plan = Plan(layer_shard=layer_shard(series, "dp") if series else None, offload=offload, prefetch_step=k)
    plan = resolved(cfg, plan)
    model = family_of(cfg)
    full, specs = model.init_params(cfg, seed=0), model.param_specs(cfg, plan)
    if plan.layer_shard is not None:
        full, specs = stack_series(full, plan.layer_shard), series_specs(specs, plan.layer_shard, cfg.num_layers)
    if plan.offload:
        full, specs = stack_host(full, plan.offload), host_specs(specs, plan.offload, cfg.num_layers)
    params = shard(full, specs, mesh, placement=place(cfg, mesh, plan))
    plan = params.placement.plan
    state = init_state(cfg, mesh, batch, 16, params["embed"].dtype, plan=plan)
    tokens = torch.ones(batch, 1, dtype=torch.long)
    with torch.no_grad(), Transfers():
        state = state._replace(prefetched=prefetch.start(params, mesh, ring_of(params, mesh, plan)))
        started = dict(counts)
        for step in range(steps):
            forward(params, tokens, torch.full((batch, 1), step), state, mesh, plan=plan, attention="math")
    return {"started": started, "total": counts}
