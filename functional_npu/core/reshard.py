"""``reshard``: move a tree of local shards from one layout to another in one planned exchange, or in buckets.

The plan is pure data (:mod:`.reshard_plan`, each rank's part in :mod:`.reshard_program`, the buckets in
:mod:`.buckets`), the run walks it (:mod:`.reshard_run`); this module is the transform over trees, validating
everything before any byte moves, and the face of the four (their public names are importable from here). Each
rank receives exactly the bytes it needs and does not hold, each from one holder, plus at most 7 bytes of padding
per peer per bucket; with ``bucket_bytes`` a rank's send plus receive buffers never take more than that, a leaf too
big for a bucket moving in slabs of its dim-0 rows. It traces with ``torch.compile(fullgraph=True)``; the source
tree is never modified.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .buckets import check_bucket_bytes
from .layout import Layout
from .mesh import Mesh
from .reshard_plan import RankTraffic, ReshardPlan, plan_reshard
from .reshard_program import LeafPlan, LeafSteps, ReshardProgram, Transfer
from .reshard_run import Source, device_of, pack, run_buckets, simulate, source_of, unpack
from .shard import check_leaf, full_shape, leaf_specs, positioned
from .tree import PyTree, flatten_with_paths, map_with_path

__all__ = [
    "Transfer",
    "LeafPlan",
    "ReshardPlan",
    "RankTraffic",
    "ReshardProgram",
    "LeafSteps",
    "Source",
    "plan_reshard",
    "reshard",
    "pack",
    "unpack",
    "simulate",
    "run_buckets",
    "check_program",
]


def reshard(
    tree: PyTree,
    src_specs: PyTree,
    dst_specs: PyTree,
    mesh: Mesh,
    *,
    plan: ReshardPlan | None = None,
    bucket_bytes: int | None = None,
) -> PyTree:
    """This rank's tree in ``dst_specs`` from its tree in ``src_specs``: one planned ``all_to_all_single``, or one
    per bucket.

    Collective: every rank of the mesh calls it with the same specs. Each rank receives only the
    bytes it needs and does not already hold, each from one holder (and the padding that starts each
    peer's section on an 8-byte boundary). Traceable with
    ``torch.compile(fullgraph=True)`` (create the process groups first: run once eagerly or call
    ``mesh.init_groups(plan.axes)``).

    Args:
        tree: this rank's local shards, laid out by ``src_specs``.
        src_specs, dst_specs: trees of :class:`Layout` (each may be a prefix of ``tree``).
        mesh: a mesh with this rank's coordinate (from ``make_mesh``).
        plan: a plan from :func:`plan_reshard` for these shapes and specs (else computed here).
        bucket_bytes: the most bytes this rank's send plus receive buffers take at once: the leaves are
            exchanged in buckets, in leaf order, each unpacked before the next is packed, a leaf too big for a bucket
            cut along its dim 0 into slabs of whole rows, each written into the destination leaf at its rows
            (``None``: one exchange). With ``plan``, it must be the plan's own. The extra memory (beside the
            result) is then at most one bucket's buffers.

    Returns:
        A new tree (same structure, never aliasing ``tree``) of local shards laid out by ``dst_specs``.

    Raises:
        TypeError, LayoutError (a ValueError) naming the leaf, dim, sizes and mesh axis, before any byte moves;
        ValueError for a ``bucket_bytes`` that is not positive or is below what one dim-0 row of a leaf takes.

    Example:
        >>> inference = reshard(train, megatron_specs(cfg), llama.param_specs(cfg), mesh)   # doctest: +SKIP
    """
    mesh = positioned(mesh, None)
    check_bucket_bytes(bucket_bytes, "reshard")
    src, dst = leaf_specs(src_specs, tree), leaf_specs(dst_specs, tree)
    local = {path: check_leaf(path, x) for path, x in flatten_with_paths(tree)}
    plan = _plan_for(local, src, dst, mesh, plan, bucket_bytes)
    check_program(plan, mesh.rank, local, src, dst)
    out: dict[str, torch.Tensor] = {}

    def done(path: str, x: torch.Tensor) -> None:
        out[path] = x

    run_buckets(plan, mesh, source_of(local), done, device_of(local))
    return map_with_path(lambda path, _: out[path], tree)


def _plan_for(
    local: Mapping[str, torch.Tensor],
    src: Mapping[str, Layout],
    dst: Mapping[str, Layout],
    mesh: Mesh,
    plan: ReshardPlan | None,
    bucket_bytes: int | None = None,
) -> ReshardPlan:
    """``plan``, checked to be for this mesh, or a new plan for these local shards (which validates every layout)."""
    if plan is None:
        shapes = {path: (full_shape(path, x, src[path], mesh), x.dtype) for path, x in local.items()}
        return plan_reshard(shapes, src, dst, mesh, bucket_bytes=bucket_bytes)  # validates every destination layout
    if dict(plan.mesh_shape) != mesh.shape:
        raise ValueError(
            f"reshard: the plan is for mesh {dict(plan.mesh_shape)} "
            f"but the mesh is {mesh.shape}; plan again with this mesh"
        )
    if bucket_bytes is not None and bucket_bytes != plan.bucket_bytes:
        raise ValueError(
            f"reshard: the plan was made with bucket_bytes={plan.bucket_bytes}, but bucket_bytes={bucket_bytes} was "
            f"given; plan again with bucket_bytes={bucket_bytes}, or leave it out to run the plan's buckets"
        )
    return plan


def check_program(
    plan: ReshardPlan,
    rank: int,
    local: Mapping[str, torch.Tensor],
    src: Mapping[str, Layout],
    dst: Mapping[str, Layout],
) -> None:
    """Raise (before any byte moves) unless ``plan`` was made for these leaves, shapes, dtypes and layouts on
    ``rank`` (``local``: the tensors, or meta tensors of their shapes and dtypes)."""
    program = plan.programs[rank]
    planned = [p for p, _, _, _, _ in program.leaves]
    if planned != list(local):
        missing, extra = [p for p in local if p not in planned], [p for p in planned if p not in local]
        if missing or extra:
            what = "; ".join(
                f"{label} {len(ps)} leaves ({', '.join(ps[:3])}{', ...' if len(ps) > 3 else ''})"
                for label, ps in (("it lacks the tree's", missing), ("it has", extra))
                if ps
            )
            what += " the tree does not" if extra else ""
        else:
            first = next(i for i, (a, b) in enumerate(zip(planned, local)) if a != b)
            tree = list(local)[first]
            what = f"it orders the same leaves otherwise (at #{first}: {planned[first]!r}, the tree {tree!r})"
        raise ValueError(f"reshard: the plan was made for another tree: {what}; plan again for this tree")
    for path, shape, dtype, src_layout, dst_layout in program.leaves:
        x = local[path]
        if tuple(x.shape) != shape or x.dtype != dtype:
            raise ValueError(
                f"reshard: params[{path!r}] is {tuple(x.shape)} {x.dtype} on rank {rank} but the plan expects {shape} "
                f"{dtype} for {src_layout!r}; was it sharded with another layout or mesh? plan again for this tree"
            )
        if src[path] != src_layout or dst[path] != dst_layout:
            raise ValueError(
                f"reshard: the plan was made for params[{path!r}] going {src_layout!r} -> {dst_layout!r}, but these "
                f"params go {src[path]!r} -> {dst[path]!r}; plan again for these layouts"
            )
