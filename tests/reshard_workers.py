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
    round trip bit-equal per leaf, source untouched, aliasing, op list).
    """
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
    out = fwd(local)
    back = back_fn(out)
    ref = shard(tree, dst, mesh)
    bits = lambda x: x.contiguous().view(torch.uint8)  # noqa: E731
    equal = {k: out[k].dtype == ref[k].dtype and torch.equal(bits(out[k]), bits(ref[k])) for k in tree}
    round_trip = {k: torch.equal(bits(back[k]), bits(local[k])) for k in tree}
    untouched = all(torch.equal(bits(local[k]), bits(before[k])) for k in tree)
    aliased = any(out[k].untyped_storage().data_ptr() == local[k].untyped_storage().data_ptr() for k in tree if out[k].numel())
    return equal, round_trip, untouched, aliased, ops
