"""A named device mesh over the torch.distributed world.

Ranks are laid out row-major over the axes: with axes ``{"dp": 2, "tp": 4}`` rank ``r`` has
coordinate ``dp = r // 4, tp = r % 4``. A collective over one axis, or over several axes at
once (given in mesh order), runs in the group of ranks that differ only along those axes; its
rank order is the row-major coordinate along them. Indices along several axes
(``axis_index``, ``group_ranks``) may also name them in another order: the index is then
row-major in the order given (a layout that cuts over ``tp`` before ``dp``).

A :class:`Mesh` is immutable. ``Mesh.abstract`` gives one with no process group, for planning
and single-process tests; ``make_mesh`` binds one to the initialized world. Process groups are
created lazily, the first time an axis (or axis tuple) is used outside a traced region, and
cached per distinct rank set in a cache shared by every mesh derived from the same world
(``split``, ``flatten``, ``at``). Group creation is collective: every rank creates every group
of that axis, in the same order, so SPMD code cannot deadlock on it.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Union

import torch
import torch.distributed as dist

__all__ = ["Mesh", "make_mesh", "Axes"]

Axes = Union[str, Sequence[str]]


@dataclass(eq=False)
class _GroupCache:
    """Process groups of one world, keyed by their sorted rank tuple (shared by derived meshes)."""

    timeout: datetime.timedelta
    names: dict[tuple[int, ...], str] = field(default_factory=dict)
    created: set[tuple[int, ...]] = field(default_factory=set)


@dataclass(frozen=True)
class Mesh:
    """Named mesh axes, this process's place on them, and (unless abstract) its process groups.

    Attributes:
        axis_names: axis names in mesh order (slowest-varying first).
        axis_sizes: size of each axis.
        rank: this process's rank in the world, or None for an abstract mesh with no coordinate.
        device_type: the device collectives run on ("cpu" for gloo, "cuda", "npu").
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    rank: int | None = None
    device_type: str = "cpu"
    _groups: _GroupCache | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        names, sizes = self.axis_names, self.axis_sizes
        if len(names) != len(sizes):
            raise ValueError(f"mesh axis names {names} and sizes {sizes} differ in length")
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be distinct, got {names}")
        for n, s in zip(names, sizes):
            if not isinstance(n, str) or not n.isidentifier():
                raise ValueError(f"mesh axis name {n!r} must be an identifier string such as 'tp'")
            if not isinstance(s, int) or isinstance(s, bool) or s < 1:
                raise ValueError(f"mesh axis {n!r} has size {s!r}; sizes must be positive ints")
        if self.rank is not None and not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a mesh of {self.size} ranks {self.shape}")

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def abstract(axes: Mapping[str, int], coordinate: Mapping[str, int] | int | None = None) -> Mesh:
        """A mesh with no process group: for planning, and for ``shard`` in a single process.

        Args:
            axes: ordered axis sizes, e.g. ``{"dp": 2, "tp": 4}``.
            coordinate: this mesh's position, as ``{"dp": 1, "tp": 3}`` or a flat rank; None for none.

        Example:
            >>> Mesh.abstract({"dp": 2, "tp": 4}, {"dp": 1, "tp": 2}).rank
            6
        """
        if not isinstance(axes, Mapping):
            raise TypeError(
                f"Mesh.abstract: axes must be a mapping of axis name to size such as {{'dp': 2, 'tp': 4}}, got "
                f"{axes!r}; pass dict(...) of it"
            )
        mesh = Mesh(tuple(axes), tuple(axes.values()))
        return mesh if coordinate is None else mesh.at(coordinate)

    def at(self, coordinate: Mapping[str, int] | int) -> Mesh:
        """An abstract copy of this mesh placed at ``coordinate`` (dict of axis -> index, or a flat rank)."""
        if isinstance(coordinate, Mapping):
            unknown = set(coordinate) - set(self.axis_names)
            if unknown:
                raise ValueError(f"coordinate names unknown axes {sorted(unknown)}; mesh axes are {self.shape}")
            missing = [a for a in self.axis_names if a not in coordinate]
            if missing:
                raise ValueError(f"coordinate {dict(coordinate)} lacks axes {missing} of mesh {self.shape}")
            for a, s in zip(self.axis_names, self.axis_sizes):
                if not 0 <= coordinate[a] < s:
                    raise ValueError(f"coordinate {a}={coordinate[a]} is outside mesh axis {a!r} of size {s}")
            rank = sum(coordinate[a] * st for a, st in zip(self.axis_names, self._strides()))
        else:
            rank = int(coordinate)
        return dataclasses.replace(self, rank=rank, _groups=None)

    def split(self, axis: str, names: Sequence[str], sizes: Sequence[int]) -> Mesh:
        """Split ``axis`` into sub-axes (row-major), keeping every rank where it is.

        Example: vllm-ascend's o_proj TP group over DP ranks is the inner part of ``dp``:
            >>> Mesh.abstract({"dp": 4, "tp": 1}).split("dp", ("dp_outer", "otp"), (2, 2)).shape
            {'dp_outer': 2, 'otp': 2, 'tp': 1}
        """
        self._check_axes((axis,), what="split")
        i = self.axis_names.index(axis)
        if len(names) != len(sizes) or math.prod(sizes) != self.axis_sizes[i]:
            raise ValueError(
                f"cannot split mesh axis {axis!r} (size {self.axis_sizes[i]}) into {tuple(names)} of sizes "
                f"{tuple(sizes)}: the sizes must multiply to {self.axis_sizes[i]}"
            )
        clash = set(names) & (set(self.axis_names) - {axis})
        if clash:
            raise ValueError(f"split of {axis!r}: names {sorted(clash)} are already axes of mesh {self.shape}")
        return dataclasses.replace(
            self,
            axis_names=self.axis_names[:i] + tuple(names) + self.axis_names[i + 1 :],
            axis_sizes=self.axis_sizes[:i] + tuple(sizes) + self.axis_sizes[i + 1 :],
        )

    def flatten(self, axes: Sequence[str], name: str) -> Mesh:
        """Merge adjacent axes (in mesh order) into one named axis, e.g. ``("dp", "tp") -> "ep"``.

        To run one collective over non-adjacent axes without renaming, pass the axis tuple to it.
        """
        axes = self._check_axes(tuple(axes), what="flatten")
        i = self.axis_names.index(axes[0])
        if self.axis_names[i : i + len(axes)] != axes:
            raise ValueError(
                f"flatten needs adjacent axes in mesh order; {axes} are not adjacent in {self.axis_names}. "
                f"Pass the axis tuple to the collective instead, or split/reorder the mesh first"
            )
        if name in self.axis_names and name not in axes:
            raise ValueError(f"flatten: {name!r} is already an axis of mesh {self.shape}")
        return dataclasses.replace(
            self,
            axis_names=self.axis_names[:i] + (name,) + self.axis_names[i + len(axes) :],
            axis_sizes=self.axis_sizes[:i] + (self.axis_size(axes),) + self.axis_sizes[i + len(axes) :],
        )

    # ---- shape and coordinates ------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    @property
    def size(self) -> int:
        return math.prod(self.axis_sizes)

    @property
    def is_abstract(self) -> bool:
        return self._groups is None

    @property
    def coordinate(self) -> dict[str, int]:
        """This rank's index on every axis."""
        return dict(zip(self.axis_names, self._coord_of(self._require_rank())))

    def axis_size(self, axes: Axes) -> int:
        """Size of an axis, or the product of several (in any order)."""
        return math.prod([self.axis_sizes[self.axis_names.index(a)] for a in self._check_axes(axes, ordered=False)])

    def axis_index(self, axes: Axes) -> int:
        """This rank's row-major index along ``axes``, in the order given (in mesh order: its rank in that axis
        group)."""
        return self._index_of(self._require_rank(), self._check_axes(axes, ordered=False))

    def group_ranks(self, axes: Axes) -> tuple[int, ...]:
        """World ranks of this rank's group along ``axes``, ordered by their index along them."""
        axes = self._check_axes(axes, ordered=False)
        rank = self._require_rank()
        return [g for g in self.all_group_ranks(axes) if rank in g][0]

    def all_group_ranks(self, axes: Axes) -> list[tuple[int, ...]]:
        """Every group along ``axes``: a partition of the world's ranks, each ordered by index along ``axes``
        (row-major in the order given)."""
        axes = self._check_axes(axes, ordered=False)
        others = [i for i, a in enumerate(self.axis_names) if a not in axes]
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.size):
            c = self._coord_of(r)
            groups.setdefault(tuple([c[i] for i in others]), []).append(r)
        return [tuple(sorted(g, key=lambda r: self._index_of(r, axes))) for _, g in sorted(groups.items())]

    # ---- process groups ---------------------------------------------------------------------
    def group_name(self, axes: Axes) -> str:
        """Name of the process group along ``axes`` (what functional collectives take).

        Created on first use (collectively, on every rank); under tracing it must already exist.
        """
        ranks = self.group_ranks(self._check_axes(axes))
        cache = self._require_groups()
        name = cache.names.get(ranks)
        if name is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"the process group for mesh axes {self._check_axes(axes)} does not exist yet and cannot be "
                    f"created while tracing; call mesh.init_groups({self._check_axes(axes)!r}) (or run the function "
                    f"once eagerly) before torch.compile"
                )
            self.init_groups(axes)
            name = cache.names[ranks]
        return name

    def init_groups(self, *axes_list: Axes) -> None:
        """Create (collectively, once) the process groups for each axis or axis tuple; default: every axis."""
        cache = self._require_groups()
        for axes in axes_list or tuple((a,) for a in self.axis_names):
            for ranks in self.all_group_ranks(self._check_axes(axes)):
                if ranks in cache.created:
                    continue
                cache.created.add(ranks)
                if len(ranks) == dist.get_world_size():
                    group = dist.group.WORLD
                else:
                    group = dist.new_group(list(ranks), timeout=cache.timeout)
                if self.rank in ranks:
                    cache.names[ranks] = group.group_name  # type: ignore[union-attr]

    def device_mesh(self) -> torch.distributed.device_mesh.DeviceMesh:
        """This mesh as a ``torch.distributed.device_mesh.DeviceMesh`` (same groups), for DTensor interop."""
        from torch.distributed.device_mesh import DeviceMesh

        self.init_groups()
        groups = [dist.distributed_c10d._resolve_process_group(self.group_name(a)) for a in self.axis_names]
        layout = torch.arange(self.size).reshape(self.axis_sizes)
        return DeviceMesh.from_group(groups, self.device_type, mesh=layout, mesh_dim_names=self.axis_names)

    # ---- helpers ---------------------------------------------------------------------------
    def _strides(self) -> tuple[int, ...]:
        return tuple([math.prod(self.axis_sizes[i + 1 :]) for i in range(len(self.axis_sizes))])

    def _coord_of(self, rank: int) -> tuple[int, ...]:
        return tuple([(rank // st) % s for s, st in zip(self.axis_sizes, self._strides())])

    def _index_of(self, rank: int, axes: tuple[str, ...]) -> int:
        coord = dict(zip(self.axis_names, self._coord_of(rank)))
        index = 0
        for a in axes:
            index = index * self.shape[a] + coord[a]
        return index

    def _check_axes(self, axes: Axes, what: str = "collective", *, ordered: bool = True) -> tuple[str, ...]:
        """``axes`` as a tuple of known, distinct axes; in mesh order unless not ``ordered`` (a collective's group
        is ordered by world rank, so it runs over axes in mesh order)."""
        # one known axis: nothing to check, and no sets or comprehensions for dynamo to trace at every call
        if isinstance(axes, str) and axes in self.axis_names:
            return (axes,)
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in axes if a not in self.axis_names]
        if unknown:
            raise ValueError(f"{what}: unknown mesh axis {unknown[0]!r}; mesh axes are {self.shape}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{what}: axis repeated in {axes}")
        order = tuple([a for a in self.axis_names if a in axes])
        if ordered and order != axes:
            raise ValueError(f"{what}: axes {axes} must be given in mesh order; write {order}")
        return axes

    def _require_rank(self) -> int:
        if self.rank is None:
            raise ValueError(f"abstract mesh {self.shape} has no coordinate; use mesh.at({{...}}) or pass coordinate=")
        return self.rank

    def _require_groups(self) -> _GroupCache:
        if self._groups is None:
            raise RuntimeError(
                f"mesh {self.shape} is abstract (no process group): collectives need a mesh from "
                f"make_mesh(...) in an initialized torch.distributed world"
            )
        return self._groups

    def __repr__(self) -> str:
        kind = "abstract " if self.is_abstract else ""
        where = "" if self.rank is None else f", rank={self.rank} {self.coordinate}"
        return f"Mesh({kind}{self.shape}{where})"


def _default_device_type() -> str:
    backend = dist.get_backend()
    return {"nccl": "cuda", "hccl": "npu"}.get(str(backend), "cpu")


def make_mesh(
    axes: Mapping[str, int],
    device_type: str | None = None,
    *,
    timeout: datetime.timedelta = datetime.timedelta(seconds=120),
) -> Mesh:
    """Bind named axes to the initialized torch.distributed world.

    Args:
        axes: ordered axis sizes whose product is the world size, e.g. ``{"dp": 2, "tp": 4}``.
        device_type: "cpu", "cuda" or "npu"; default from the process group backend.
        timeout: for creating process groups (and the operations on them).

    Returns:
        A :class:`Mesh` with this process's coordinate; process groups are created on first use.

    Example:
        >>> mesh = make_mesh({"tp": dist.get_world_size()})      # doctest: +SKIP
        >>> y = all_reduce(x, mesh, "tp")                         # doctest: +SKIP
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "make_mesh needs an initialized torch.distributed world (dist.init_process_group); "
            "for planning without one use Mesh.abstract(axes)"
        )
    world = dist.get_world_size()
    size = math.prod(axes.values()) if axes else 1
    if size != world:
        raise ValueError(
            f"mesh axes {dict(axes)} hold {size} ranks but the world has {world}; choose sizes whose product is {world}"
        )
    return Mesh(
        tuple(axes),
        tuple(axes.values()),
        rank=dist.get_rank(),
        device_type=device_type or _default_device_type(),
        _groups=_GroupCache(timeout=timeout),
    )
