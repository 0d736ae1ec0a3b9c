"""Functions the reshard tests run on every rank (module level, so they pickle by reference)."""

from __future__ import annotations

import torch

from functional_npu import plan_reshard, reshard, shard

from .strategies import make_tensor
from .workers import compiled


def reshard_case(ctx, axes, leaves, seed: int, use_compile: bool, planned: bool = True):
    """Shard a seeded tree by the source layouts, reshard to the destination ones and back on the gloo world.

    ``planned``: pass plans made beforehand (else ``reshard`` plans inside the traced region).
    ``leaves``: ``[(shape, dtype, src layout, dst layout)]``. Returns (bit-equal to shard_B per leaf,
    round trip bit-equal per leaf, source untouched, aliasing, op list, and eagerly: per direction, the bytes this
    rank received counted at the collectives and its lower bound from element indices (None when compiled)).
    """
    from benchmarks.counting import ReceivedBytes, need_of_layouts

    mesh = ctx.mesh(axes)
    tree = {f"w{i}": make_tensor(shape, dtype, seed + i) for i, (shape, dtype, _, _) in enumerate(leaves)}
    src = {f"w{i}": a for i, (_, _, a, _) in enumerate(leaves)}
    dst = {f"w{i}": b for i, (_, _, _, b) in enumerate(leaves)}
    local = shard(tree, src, mesh)
    before = {k: v.clone() for k, v in local.items()}
    ops: list[str] = []
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in tree.items()}
    there = plan_reshard(shapes, src, dst, mesh) if planned else None
    back = plan_reshard(shapes, dst, src, mesh) if planned else None
    fwd, back_fn = (lambda t: reshard(t, src, dst, mesh, plan=there)), (lambda t: reshard(t, dst, src, mesh, plan=back))
    if use_compile:
        mesh.init_groups(tuple(axes))
        fwd, back_fn = compiled(fwd, ops), compiled(back_fn, ops)
    if use_compile:  # torch.compile refuses a dispatch mode around it: compiled runs are not counted
        out = fwd(local)
        back = back_fn(out)
        traffic = None
    else:
        with ReceivedBytes() as counted_there:
            out = fwd(local)
        with ReceivedBytes() as counted_back:
            back = back_fn(out)
        traffic = {
            "there": (counted_there.received, need_of_layouts(shapes, src, dst, mesh, mesh.rank).missing),
            "back": (counted_back.received, need_of_layouts(shapes, dst, src, mesh, mesh.rank).missing),
        }
    ref = shard(tree, dst, mesh)
    bits = lambda x: x.contiguous().view(torch.uint8)  # noqa: E731
    equal = {k: out[k].dtype == ref[k].dtype and torch.equal(bits(out[k]), bits(ref[k])) for k in tree}
    round_trip = {k: torch.equal(bits(back[k]), bits(local[k])) for k in tree}
    untouched = all(torch.equal(bits(local[k]), bits(before[k])) for k in tree)
    aliased = any(
        out[k].untyped_storage().data_ptr() == local[k].untyped_storage().data_ptr() for k in tree if out[k].numel()
    )
    return equal, round_trip, untouched, aliased, ops, traffic


def megatron_parity(ctx, model_dir: str, prompts, new_tokens: int, vpp: int):
    """Megatron TP=2 x PP=2 (vpp chunks) on a {pp: 2, tp: 2} world -> inference layouts; greedy tokens of each.

    Returns {target: (tokens, bit-equal to shard of the full params, received bytes, all-gather-then-slice bytes)}.
    """
    from functional_npu import Cyclic, Mesh, greedy_generate, leaf_specs, replicated
    from functional_npu.core.tree import flatten_with_paths
    from functional_npu.interop.megatron import (
        from_megatron,
        megatron_pipeline_specs,
        stack_layers,
        stacked_specs,
        to_megatron,
        unstack_layers,
    )
    from functional_npu.models.llama import param_specs
    from functional_npu.runtime.loading.checkpoint import load_checkpoint

    mesh = ctx.mesh({"pp": 2, "tp": 2})
    full = load_checkpoint(model_dir, Mesh.abstract({"tp": 1}, 0))
    cfg = full.config
    stacked = stack_layers(full)
    src = megatron_pipeline_specs(cfg, pp=2, vpp=vpp)
    train = from_megatron(
        to_megatron(shard(stacked, src, mesh), vpp), cfg, src, mesh
    )  # what a Megatron rank holds, by name
    tp2 = stacked_specs(param_specs(cfg))
    targets = {
        "tp2": tp2,
        "tp1": replicated(),
        "layer_sharded": stacked_specs(param_specs(cfg), Cyclic("pp", cfg.num_layers)),
    }
    out = {}
    for name, dst in targets.items():
        shapes = {p: (tuple(x.shape), x.dtype) for p, x in flatten_with_paths(stacked)}
        plan = plan_reshard(shapes, leaf_specs(src, stacked), leaf_specs(dst, stacked), mesh)
        got = reshard(train, src, dst, mesh, plan=plan)
        want = shard(stacked, dst, mesh)
        equal = all(torch.equal(a, b) for (_, a), (_, b) in zip(flatten_with_paths(got), flatten_with_paths(want)))
        if (
            name == "layer_sharded"
        ):  # no forward for layer-sharded params on this branch: reshard on to tp=2 and run that
            got, run_mesh = reshard(got, dst, tp2, mesh), mesh
        else:
            run_mesh = mesh if name == "tp2" else Mesh.abstract({"tp": 1}, 0)
        with torch.no_grad():
            tokens = greedy_generate(unstack_layers(got), prompts, new_tokens, run_mesh)
        traffic = plan.traffic[mesh.rank]
        out[name] = (tokens, equal, traffic.received, traffic.allgather_slice)
    return out
