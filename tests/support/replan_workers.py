"""Rank jobs for resharding params between plans: the result against the loader's, and the bytes moved against
what this rank needs and does not hold, counted from element ids (no resharding code involved)."""

import torch


def replan(ctx, model_dir: str, axes: dict, src_fields: dict, dst_fields: dict):
    """Load ``model_dir`` under the source plan, reshard to the destination plan; returns whether every leaf equals
    ``load_checkpoint`` under the destination plan (and the trees have one structure), the bytes received (the
    plan's count and the exchange's own), and the independent need."""
    from functional_npu import Plan, flatten_with_paths, load_checkpoint
    from functional_npu.runtime.training.weight_sync import plan_params_reshard, reshard_params

    mesh = ctx.mesh(axes)
    src, dst = Plan(**src_fields), Plan(**dst_fields)
    params = load_checkpoint(model_dir, mesh, src)
    before = {p: x.clone() for p, x in flatten_with_paths(params) if isinstance(x, torch.Tensor)}
    got = reshard_params(params, dst, mesh)
    want_tree = load_checkpoint(model_dir, mesh, dst)
    want = dict(flatten_with_paths(want_tree))
    have = dict(flatten_with_paths(got))
    same = set(have) == set(want) and all(
        torch.equal(have[p], w) for p, w in want.items() if isinstance(w, torch.Tensor)
    )
    untouched = all(torch.equal(x, dict(flatten_with_paths(params))[p]) for p, x in before.items())
    same_structure = type(got["layers"]) is type(want_tree["layers"]) and ("series" in got) == ("series" in want_tree)
    traffic = plan_params_reshard(params, dst, mesh).traffic[mesh.rank]
    return {
        "same": same and same_structure,
        "untouched": untouched,
        "received": traffic.received,
        "lower_bound": traffic.lower_bound,
        "need": need_bytes(params.config, mesh, src, dst),
    }


def need_bytes(cfg, mesh, src, dst) -> int:
    """Bytes of the destination shards this rank does not hold under the source plan: every element of the full
    model numbered once (per layer, unstacked), each plan's full tree built from those numbers (a layer-sharded
    series stacked by the loader's own ``stack_series``), both cut for this rank by ``shard``."""
    from functional_npu import flatten_with_paths, shard
    from functional_npu.models import family_of
    from functional_npu.parallel.layer_shard import stack_series

    family = family_of(cfg)
    meta = family.abstract_params(cfg)
    ids, at = {}, 0
    for path, x in flatten_with_paths(meta):
        ids[path] = torch.arange(at, at + x.numel()).reshape(x.shape)
        at += x.numel()
    numbered = {k: v for k, v in meta.items() if not isinstance(v, torch.Tensor) and k != "layers"}
    numbered |= {k: ids[k] for k, v in meta.items() if isinstance(v, torch.Tensor)}
    numbered["layers"] = [{leaf: ids[f"layers.{i}.{leaf}"] for leaf in layer} for i, layer in enumerate(meta["layers"])]

    def cut(plan):
        tree = stack_series(numbered, series_for(cfg, plan)) if plan.layer_shard else numbered
        specs = family.param_specs(cfg, plan)
        if plan.layer_shard:
            from functional_npu.parallel.layer_shard import series_specs

            specs = series_specs(specs, series_for(cfg, plan), cfg.num_layers)
        local = shard({k: v for k, v in tree.items() if k in specs}, specs, mesh)
        return torch.cat([x.flatten() for _, x in flatten_with_paths(local) if isinstance(x, torch.Tensor)])

    held, needed = cut(src), cut(dst)
    itemsize = next(x for _, x in flatten_with_paths(meta) if isinstance(x, torch.Tensor)).element_size()
    return int((~torch.isin(needed, held)).sum()) * itemsize


def series_for(cfg, plan):
    from functional_npu.models import series_leaves

    return series_leaves(cfg, plan.layer_shard, plan)


def bucketed_sync(ctx, model_dir: str, axes: dict, src_fields: dict, dst_fields: dict, share: float):
    """Load ``model_dir`` under the source plan and sync it to the destination plan twice, unbucketed and in buckets
    of ``share`` of the largest stacked leaf on any rank (at least what the costliest layer of a leaf takes); each
    run inside
    :class:`benchmarks.memory.LiveBytes` and :class:`benchmarks.counting.ReceivedBytes`. Returns, for this rank:
    the bucket size, the largest leaf (stacked form, source or destination) and the largest stacked one, the leaves
    cut into slabs, whether the bucketed result is bitwise
    the unbucketed one and the loader's under the destination plan, and per run the peak bytes held beside the
    result, the bytes received counted at the all_to_all_single calls, and how many there were; the plan's bytes
    received, its lower bound and its buckets."""
    import math

    from benchmarks.counting import ReceivedBytes
    from benchmarks.memory import LiveBytes
    from functional_npu import Plan, flatten_with_paths, load_checkpoint
    from functional_npu.core.buckets import bucket_cost, slab_costs
    from functional_npu.runtime.training.weight_sync import plan_params_reshard, reshard_params

    mesh = ctx.mesh(axes)
    src, dst = Plan(**src_fields), Plan(**dst_fields)
    params = load_checkpoint(model_dir, mesh, src)
    whole = plan_params_reshard(params, dst, mesh)
    moves = {leaf.path: [t.move() for t in whole.transfers if t.path == leaf.path] for leaf in whole.leaves}
    rows = {leaf.path: leaf.full_shape[0] if leaf.full_shape else 1 for leaf in whole.leaves}
    least = max(
        max(bucket_cost(slab_costs(moves[p], i, i + 1)).values(), default=0) for p in rows for i in range(rows[p])
    )
    item = {leaf.path: torch.empty((), dtype=leaf.dtype).element_size() for leaf in whole.leaves}
    size = {
        leaf.path: max(
            math.prod(s) * item[leaf.path] for r in range(mesh.size) for s in (leaf.src_shapes[r], leaf.dst_shapes[r])
        )
        for leaf in whole.leaves
    }
    stacked = max(n for p, n in size.items() if p.startswith("stack."))
    bucket = max(least, int(stacked * share))
    largest = max(
        math.prod(shape) * item[leaf.path]
        for leaf in whole.leaves
        for shape in (leaf.src_shapes[mesh.rank], leaf.dst_shapes[mesh.rank])
    )
    runs, results = {}, {}
    for name, size in (("whole", None), ("buckets", bucket)):
        with ReceivedBytes() as counted, LiveBytes() as mem:
            got = reshard_params(params, dst, mesh, bucket_bytes=size)
        tensors = [x for _, x in flatten_with_paths(got) if isinstance(x, torch.Tensor)]
        op = "_c10d_functional.all_to_all_single"
        runs[name] = {"peak": mem.peak_beside(tensors), "received": counted.by_op[op], "calls": counted.calls[op]}
        results[name] = dict(flatten_with_paths(got))
    plan = plan_params_reshard(params, dst, mesh, bucket_bytes=bucket)
    want = dict(flatten_with_paths(load_checkpoint(model_dir, mesh, dst)))
    bits = lambda x: x.contiguous().view(torch.uint8)  # noqa: E731
    same = lambda a, b: a.dtype == b.dtype and torch.equal(bits(a), bits(b))  # noqa: E731
    tensors = {p for p, w in want.items() if isinstance(w, torch.Tensor)}
    traffic = plan.traffic[mesh.rank]
    return {
        "bucket": bucket,
        "largest": largest,
        "largest_stacked": stacked,
        "cut": sorted({p for b in plan.slabs for p, a, z in b if (a, z) != (0, rows[p])}),
        "same_as_whole": all(same(results["buckets"][p], results["whole"][p]) for p in tensors),
        "same_as_loader": set(results["buckets"]) == set(want)
        and all(same(results["buckets"][p], want[p]) for p in tensors),
        "runs": runs,
        "received": traffic.received,
        "lower_bound": traffic.lower_bound,
        "buckets": len(plan.buckets),
        "moving_buckets": sum(any(sum(p.send_sizes) for p in progs) for progs in plan.buckets),
        "peers": len(plan.programs[mesh.rank].group) - 1,
    }


def disagreeing_buckets(ctx, model_dir: str, axes: dict, src_fields: dict, dst_fields: dict):
    """Each rank reshards with its own ``bucket_bytes`` (rank r: 2 ** (20 + r)): the error every rank raises before
    the exchange (once: an abort inside gloo, or a rank waiting out gloo's timeout)."""
    from functional_npu import Plan, load_checkpoint
    from functional_npu.runtime.training.weight_sync import reshard_params

    mesh = ctx.mesh(axes)
    params = load_checkpoint(model_dir, mesh, Plan(**src_fields))
    try:
        reshard_params(params, Plan(**dst_fields), mesh, bucket_bytes=2 ** (20 + mesh.rank))
    except ValueError as e:
        return str(e)
    return None
