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
        "need": need_bytes(params["config"], mesh, src, dst),
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
