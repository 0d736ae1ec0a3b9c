"""Functions the reshard tests run on every rank (module level, so they pickle by reference)."""

from __future__ import annotations

import torch

from functional_npu import reshard, shard

from .strategies import make_tensor
from .workers import compiled


def reshard_case(ctx, axes, leaves, seed: int, use_compile: bool):
    """Shard a seeded tree by the source layouts, reshard to the destination ones on the gloo world.

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
    if use_compile:
        mesh.init_groups(*[a for a in [tuple(axes)] if a])
        fwd = compiled(lambda t: reshard(t, src, dst, mesh), ops)
        back_fn = compiled(lambda t: reshard(t, dst, src, mesh), ops)
    else:
        fwd, back_fn = (lambda t: reshard(t, src, dst, mesh)), (lambda t: reshard(t, dst, src, mesh))
    out = fwd(local)
    back = back_fn(out)
    ref = shard(tree, dst, mesh)
    bits = lambda x: x.contiguous().view(torch.uint8)  # noqa: E731
    equal = {k: out[k].dtype == ref[k].dtype and torch.equal(bits(out[k]), bits(ref[k])) for k in tree}
    round_trip = {k: torch.equal(bits(back[k]), bits(local[k])) for k in tree}
    untouched = all(torch.equal(bits(local[k]), bits(before[k])) for k in tree)
    aliased = any(out[k].untyped_storage().data_ptr() == local[k].untyped_storage().data_ptr() for k in tree if out[k].numel())
    return equal, round_trip, untouched, aliased, ops
