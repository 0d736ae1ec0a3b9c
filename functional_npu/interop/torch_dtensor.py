"""torch's DTensor placements and device meshes as this library's (:mod:`functional_npu.core.dtensor`), with their
arguments checked at this face: a wrong type, or a mesh axis the mesh does not have, is one line naming the argument
and a fix, never an AttributeError from inside the conversion."""

from __future__ import annotations

from typing import Any

import torch

from ..core import dtensor
from ..core.layout import Layout
from ..core.mesh import Mesh

__all__ = ["mesh_from_device_mesh", "layout_from_dtensor", "placements_of", "to_dtensor"]


def mesh_from_device_mesh(device_mesh: Any) -> Mesh:
    """The :class:`Mesh` of a ``DeviceMesh`` over the whole world (its dims named, ranks in row-major order).

    Raises:
        TypeError: ``device_mesh`` is not a ``DeviceMesh``. ValueError: one with unnamed dims, or not over the whole
        world in row-major order.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"mesh_from_device_mesh: device_mesh must be a torch DeviceMesh (init_device_mesh(device_type, shape, "
            f"mesh_dim_names=...)), got {type(device_mesh).__name__}"
        )
    return dtensor.mesh_from_device_mesh(device_mesh)


def layout_from_dtensor(dt: Any, *, path: str = "tensor") -> Layout:
    """The layout of a DTensor over its root mesh's dims (see :func:`functional_npu.core.dtensor.layout_from_dtensor`).

    Raises:
        TypeError: ``dt`` is not a DTensor. ValueError naming ``path``: a placement no layout holds.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(dt, DTensor):
        raise TypeError(
            f"layout_from_dtensor: {path} is a {type(dt).__name__}, not a DTensor; a plain tensor has no placement "
            f"(place it with distribute_tensor or DTensor.from_local)"
        )
    return dtensor.layout_from_dtensor(dt, path=path)


def placements_of(layout: Any, mesh: Any, *, path: str = "tensor") -> tuple[Any, ...]:
    """DTensor placements for ``layout`` on ``mesh`` (one per mesh axis).

    Raises:
        TypeError: ``layout`` is no :class:`Layout` or ``mesh`` no :class:`Mesh`. ValueError naming ``path``: a
        mesh axis the mesh does not have, or a layout DTensor cannot express (a cyclic layer dim, fused blocks,
        packed or grouped dims).
    """
    _check_layout(layout, mesh, path, "placements_of")
    return dtensor.placements_of(layout, mesh, path=path)


def to_dtensor(local: Any, layout: Any, mesh: Any, *, path: str = "tensor") -> Any:
    """This rank's shard as a DTensor over ``mesh.device_mesh()``, without moving data (the global shape is the
    layout's full shape).

    Raises:
        TypeError: ``local`` is not a tensor; ``layout`` or ``mesh`` as :func:`placements_of` refuses them.
        ValueError naming ``path``: as :func:`placements_of`, or a local shape that is no shard of the layout.
    """
    if not isinstance(local, torch.Tensor):
        raise TypeError(
            f"to_dtensor: local must be this rank's shard as a torch.Tensor, got {type(local).__name__}; pass the "
            f"tensor shard(...) gives this rank"
        )
    _check_layout(layout, mesh, path, "to_dtensor")
    return dtensor.to_dtensor(local, layout, mesh, path=path)


def _check_layout(layout: Any, mesh: Any, path: str, where: str) -> None:
    """``layout`` a :class:`Layout` over axes of ``mesh``, a :class:`Mesh` (see :func:`placements_of`)."""
    if not isinstance(layout, Layout):
        raise TypeError(
            f"{where}: layout must be a functional_npu.Layout (sharded(0, 'tp'), replicated(), ...), got "
            f"{type(layout).__name__}"
        )
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{where}: mesh must be a functional_npu.Mesh (Mesh.abstract({{'tp': 2}}, 0), make_mesh(...)), got "
            f"{type(mesh).__name__}"
        )
    unknown = [a for a in layout.axes() if a not in mesh.axis_names]
    if unknown:
        raise ValueError(
            f"{where}: {path}'s layout {layout} names mesh axis {unknown[0]!r}, which the mesh {mesh.shape} does not "
            f"have; use one of its axes {list(mesh.axis_names)} or a mesh with that axis"
        )
