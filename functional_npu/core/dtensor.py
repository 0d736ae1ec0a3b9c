"""torch's DTensor placements as layouts, and back: meet FSDP2 / TP states where they are.

A DTensor places a tensor on a ``DeviceMesh`` with one placement per mesh dim. Each has a layout:

- ``Replicate()`` on mesh dim ``i``: nothing (the layout does not name that axis);
- ``Shard(d)`` on mesh dims ``i1 < i2 < ...``: tensor dim ``d`` cut over those axes, in mesh order. That is
  DTensor's default order (the left mesh dim cuts first), and a :class:`~functional_npu.Shard` over several
  axes is row-major in the order written: the same pieces, bit for bit.
- ``_StridedShard(d, split_factor=f)``, as FSDP2 leaves on a tensor-parallel weight (``(dp, tp)`` mesh,
  ``(_StridedShard(0, sf=tp), Shard(0))``: tp cuts first, then dp cuts each tp piece), and an explicit shard
  order: tensor dim ``d`` cut over its axes in the order they apply, ``Shard(("tp", "dp"))``. DTensor's rule
  reads the order back from the split factors: a mesh dim's split factor is the product of the sizes of the
  mesh dims right of it that cut before it.

With no layout equivalent (an error naming the parameter and the placement, before any data moves):

- ``Partial()`` (a pending reduction: reduce it first, ``dt.redistribute(placements=[Replicate()])``);
- a dim DTensor cuts unevenly (``torch.chunk``: a layout's pieces are equal);
- split factors that no order of the dim's mesh dims produces.

A layout with no placement (a cyclic layer dim, fused blocks, packed or grouped dims) is refused by
:func:`placements_of` in the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .layout import Layout, Shard
from .mesh import Mesh, make_mesh
from .shard import local_shape

__all__ = [
    "mesh_from_device_mesh",
    "layout_from_placements",
    "layout_from_dtensor",
    "root_mesh",
    "placements_of",
    "to_dtensor",
]


def mesh_from_device_mesh(device_mesh: Any) -> Mesh:
    """The :class:`Mesh` of a ``DeviceMesh`` over the whole world (its dims named, ranks in row-major order).

    ``Mesh.device_mesh()`` goes the other way.
    """
    names = device_mesh.mesh_dim_names
    if not names:
        raise ValueError("mesh_from_device_mesh: the DeviceMesh has no mesh_dim_names; create it with names")
    ranks = device_mesh.mesh.flatten().tolist()
    if ranks != list(range(dist.get_world_size())):
        raise ValueError(
            f"mesh_from_device_mesh: the DeviceMesh {dict(zip(names, device_mesh.mesh.shape))} holds ranks {ranks}; "
            f"a Mesh is the whole world in row-major order (ranks 0 .. {dist.get_world_size() - 1})"
        )
    return make_mesh(dict(zip(names, device_mesh.mesh.shape)), device_mesh.device_type)


def layout_from_placements(
    placements: Sequence[Any],
    mesh_shape: dict[str, int],
    shape: Sequence[int],
    *,
    path: str = "tensor",
    shard_order: Sequence[Any] | None = None,
) -> Layout:
    """The layout of a tensor of (global) ``shape`` placed by ``placements`` on a mesh of ``mesh_shape``.

    ``shard_order``: a DTensorSpec's explicit order (``ShardOrderEntry(tensor_dim, mesh_dims)``, mesh dims in the
    order they cut); by default the order comes from the placements (left to right, strided shards after the
    mesh dims their split factor names).

    Raises:
        ValueError naming ``path``, the placement and its mesh dim: Partial, uneven shards, split factors with
        no order.
    """
    from torch.distributed.tensor.placement_types import _StridedShard

    names = list(mesh_shape)
    if len(placements) != len(names):
        raise ValueError(f"{path}: {len(placements)} placements for a mesh of {len(names)} dims {mesh_shape}")
    order: dict[int, list[int]] = {}  # tensor dim -> its mesh dims, in the order they cut
    for i in reversed(range(len(placements))):  # right to left: a split factor names mesh dims to its right
        p = placements[i]
        what = f"{path}: placement {p} on mesh dim {i} ({names[i]!r})"
        if p.is_replicate():
            continue
        if p.is_partial():
            raise ValueError(
                f"{what} is a pending reduction, which no layout holds; reduce it first "
                f"(dt.redistribute(placements=[Replicate()] * {len(names)}))"
            )
        if not (p.is_shard() or isinstance(p, _StridedShard)):
            raise ValueError(f"{what} has no layout equivalent")
        dims = order.setdefault(p.dim % len(shape), [])
        factor, before = getattr(p, "split_factor", 1), 1
        for k in range(len(dims) + 1):
            if before == factor:
                dims.insert(k, i)
                break
            if k < len(dims):
                before *= mesh_shape[names[dims[k]]]
        else:
            raise ValueError(
                f"{what}: split factor {factor} is no product of the sizes of the mesh dims "
                f"{[names[j] for j in dims]} that cut tensor dim {p.dim} after it; no cut order gives these pieces"
            )
    if shard_order is not None:
        order = {e.tensor_dim % len(shape): list(e.mesh_dims) for e in shard_order}
    out: list[Shard | None] = [None] * (max(order) + 1 if order else 0)
    for d, mesh_dims in order.items():
        on = tuple(names[i] for i in mesh_dims)
        n = math.prod(mesh_shape[a] for a in on)
        if shape[d] % n:
            raise ValueError(
                f"{path}: dim {d} (size {shape[d]}) is sharded over mesh axes {on} (size {n}), which DTensor "
                f"cuts unevenly and a layout cannot; pad the dim to a multiple of {n}"
            )
        out[d] = Shard(on)
    return Layout(tuple(out))


def layout_from_dtensor(dt: Any, *, path: str = "tensor") -> Layout:
    """The layout of a DTensor over its root mesh's dims (:func:`root_mesh`), after checking that one exists.

    A DTensor on a submesh (FSDP2 + TP leaves the weights TP does not cut on the ``dp_shard`` submesh) is
    replicated over the root's other dims.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import ShardOrderEntry

    spec, sub, root = dt._spec, dt.device_mesh, root_mesh(dt, path=path)
    names, own = root.mesh_dim_names, sub.mesh_dim_names
    at = [names.index(n) for n in own]  # each of the DTensor's mesh dims, as a root dim
    placements = [Replicate()] * len(names)
    for i, p in zip(at, dt.placements):
        placements[i] = p
    explicit = None if getattr(spec, "use_strided_shard_as_shard_order", True) else spec.shard_order
    if explicit is not None:
        explicit = [ShardOrderEntry(e.tensor_dim, tuple(at[i] for i in e.mesh_dims)) for e in explicit]
    return layout_from_placements(
        placements, dict(zip(names, root.mesh.shape)), dt.shape, path=path, shard_order=explicit
    )


def root_mesh(dt: Any, *, path: str = "tensor") -> Any:
    """The ``DeviceMesh`` a DTensor's mesh was sliced from (itself if it is a root), after checking that its dims
    are named dims of that root (a flattened dim names none)."""
    sub = dt.device_mesh
    root = sub._get_root_mesh() if hasattr(sub, "_get_root_mesh") else sub
    if not sub.mesh_dim_names or not root.mesh_dim_names:
        raise ValueError(f"{path}: its DeviceMesh has no mesh_dim_names; a layout names mesh axes")
    missing = [n for n in sub.mesh_dim_names if n not in root.mesh_dim_names]
    if missing:
        raise ValueError(
            f"{path}: its mesh dims {missing} are not dims of the root mesh {root.mesh_dim_names} (a flattened "
            f"submesh); place it on a slice of named root dims"
        )
    return root


def placements_of(layout: Layout, mesh: Mesh, *, path: str = "tensor") -> tuple[Any, ...]:
    """DTensor placements for ``layout`` on ``mesh`` (one per mesh axis).

    Raises:
        ValueError naming ``path`` for a layout DTensor cannot express: a cyclic layer dim, fused blocks,
        packed or grouped dims.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = [Replicate()] * len(mesh.axis_names)
    for d, spec in enumerate(layout.dims):
        if spec is None:
            continue
        if not isinstance(spec, Shard) or spec.blocks or spec.pack != 1 or spec.groups != 1 or spec.group_size != 1:
            raise ValueError(f"{path}: dim {d}'s layout {spec} has no DTensor placement (plain shards only)")
        at = [mesh.axis_names.index(a) for a in spec.axes]  # mesh dims, in the order they cut
        for k, i in enumerate(at):  # split factor: the mesh dims right of i that cut before it
            factor = math.prod([mesh.axis_sizes[j] for j in at[:k] if j > i])
            out[i] = DShard(d) if factor == 1 else _StridedShard(d, split_factor=factor)
    return tuple(out)


def to_dtensor(local: torch.Tensor, layout: Layout, mesh: Mesh, *, path: str = "tensor") -> Any:
    """This rank's shard as a DTensor over ``mesh.device_mesh()``, without moving data (the global shape is the
    layout's full shape)."""
    from torch.distributed.tensor import DTensor

    placements = placements_of(layout, mesh, path=path)  # plain shards only: each piece is 1/n of its dim
    dims = list(layout.dims) + [None] * (local.dim() - len(layout.dims))
    full = [n * (1 if spec is None else mesh.axis_size(spec.axes)) for n, spec in zip(local.shape, dims)]
    if tuple(local.shape) != local_shape(full, layout, mesh, path=path):
        raise ValueError(f"{path}: local shape {tuple(local.shape)} is not this rank's shard of {full} under {layout}")
    return DTensor.from_local(
        local, mesh.device_mesh(), placements, run_check=False, shape=torch.Size(full), stride=_contiguous(full)
    )


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
