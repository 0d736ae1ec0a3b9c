"""torch's DTensor placements as layouts, and back: meet FSDP2 / TP states where they are.

A DTensor places a tensor on a ``DeviceMesh`` with one placement per mesh dim. Each has a layout:

- ``Replicate()`` on mesh dim ``i``: nothing (the layout does not name that axis);
- ``Shard(d)`` on mesh dims ``i1 < i2 < ...``: tensor dim ``d`` cut over those axes, in mesh order. That is
  DTensor's default order (the left mesh dim cuts first), and a :class:`~functional_npu.Shard` over several
  axes is row-major in mesh order: the same pieces, bit for bit.

With no layout equivalent (an error naming the parameter and the placement, before any data moves):

- ``Partial()`` (a pending reduction: reduce it first, ``dt.redistribute(placements=[Replicate()])``);
- a dim DTensor cuts unevenly (``torch.chunk``: a layout's pieces are equal);
- ``_StridedShard`` (FSDP2 over a tp-sharded dim: its pieces are ordered tp-major, against the mesh) and
  explicit shard orders: not yet supported.

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

__all__ = ["mesh_from_device_mesh", "layout_from_placements", "layout_from_dtensor", "placements_of", "to_dtensor"]


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
    placements: Sequence[Any], mesh_shape: dict[str, int], shape: Sequence[int], *, path: str = "tensor"
) -> Layout:
    """The layout of a tensor of (global) ``shape`` placed by ``placements`` on a mesh of ``mesh_shape``.

    Raises:
        ValueError naming ``path``, the placement and its mesh dim: Partial, uneven or strided shards.
    """
    names = list(mesh_shape)
    if len(placements) != len(names):
        raise ValueError(f"{path}: {len(placements)} placements for a mesh of {len(names)} dims {mesh_shape}")
    axes: dict[int, list[str]] = {}
    for i, p in enumerate(placements):
        what = f"{path}: placement {p} on mesh dim {i} ({names[i]!r})"
        if p.is_replicate():
            continue
        if p.is_partial():
            raise ValueError(
                f"{what} is a pending reduction, which no layout holds; reduce it first "
                f"(dt.redistribute(placements=[Replicate()] * {len(names)}))"
            )
        if type(p).__name__ == "_StridedShard":
            raise ValueError(
                f"{what}: strided shards (FSDP2 over a tensor-parallel dim) order their pieces against the mesh, "
                f"which layouts do not yet express; redistribute to Shard / Replicate placements first"
            )
        if not p.is_shard():
            raise ValueError(f"{what} has no layout equivalent")
        axes.setdefault(p.dim % len(shape), []).append(names[i])
    dims: list[Shard | None] = [None] * (max(axes) + 1 if axes else 0)
    for d, on in axes.items():
        n = math.prod(mesh_shape[a] for a in on)
        if shape[d] % n:
            raise ValueError(
                f"{path}: dim {d} (size {shape[d]}) is sharded over mesh axes {tuple(on)} (size {n}), which DTensor "
                f"cuts unevenly and a layout cannot; pad the dim to a multiple of {n}"
            )
        dims[d] = Shard(tuple(on))
    return Layout(tuple(dims))


def layout_from_dtensor(dt: Any, *, path: str = "tensor") -> Layout:
    """The layout of a DTensor (over its own mesh's dim names), after checking that one exists."""
    spec = dt._spec
    if getattr(spec, "shard_order", None) and not _default_order(spec):
        raise ValueError(f"{path}: an explicit shard order {spec.shard_order} is not yet supported")
    names = dt.device_mesh.mesh_dim_names
    if not names:
        raise ValueError(f"{path}: its DeviceMesh has no mesh_dim_names; a layout names mesh axes")
    return layout_from_placements(dt.placements, dict(zip(names, dt.device_mesh.mesh.shape)), dt.shape, path=path)


def _default_order(spec: Any) -> bool:
    """Whether a DTensorSpec's shard order is the default (each dim cut by its mesh dims left to right)."""
    return all(list(entry.mesh_dims) == sorted(entry.mesh_dims) for entry in spec.shard_order)


def placements_of(layout: Layout, mesh: Mesh, *, path: str = "tensor") -> tuple[Any, ...]:
    """DTensor placements for ``layout`` on ``mesh`` (one per mesh axis).

    Raises:
        ValueError naming ``path`` for a layout DTensor cannot express: a cyclic layer dim, fused blocks,
        packed or grouped dims.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard

    out: list[Any] = [Replicate()] * len(mesh.axis_names)
    for d, spec in enumerate(layout.dims):
        if spec is None:
            continue
        if not isinstance(spec, Shard) or spec.blocks or spec.pack != 1 or spec.groups != 1 or spec.group_size != 1:
            raise ValueError(f"{path}: dim {d}'s layout {spec} has no DTensor placement (plain shards only)")
        for a in spec.axes:
            out[mesh.axis_names.index(a)] = DShard(d)
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
