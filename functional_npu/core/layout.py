"""Layout specs: how one parameter leaf is placed on a mesh. Plain immutable data.

A :class:`Layout` gives, for each leading tensor dim, either nothing (that dim is whole on
every rank) or one of:

* :class:`Shard` -- the dim is cut into contiguous pieces over one mesh axis or several: piece
  ``i`` is held by the ranks whose row-major index along the axes, in the order written, is
  ``i``. In mesh order (``("dp", "tp")``) that is DTensor's default; in another order
  (``("tp", "dp")``: cut over tp first, then each tp piece over dp) it is the strided shard FSDP2
  leaves on a tensor-parallel weight. Optionally the dim is a concatenation of named :class:`Block`\\ s
  (``[q|k|v]``, ``[gate|up]``), each cut on its own, the local shard being the concatenation of
  each block's local piece (fused column-parallel weights). A block with ``replicate=True``
  whose unit count (e.g. KV heads) is smaller than the axis size is replicated on
  ``axis_size // units`` consecutive ranks (GQA with tp > num_kv_heads). ``pack`` says how many
  logical elements one stored element holds along the dim (int4 packed in int32: 8), and
  ``group_size`` how many one stored element stands for (a quantization scale per group of 128
  inputs: 128); block sizes are logical, shard offsets and lengths are in stored units, and a
  shard must hold whole stored elements. ``groups=G`` interleaves
  the blocks: the stored dim is G groups, group ``g`` being the concatenation of every block's
  g-th 1/G slice, and the groups are cut contiguously over the axes (Megatron's grouped QKV,
  ``[q heads of group g, k_g, v_g]`` per KV group ``g``, with ``G = num_kv_heads``).
* :class:`Cyclic` -- a stacked layer dim; layer ``l`` lives on coordinate ``l % n`` of the axis,
  the other coordinates hold nothing for it.

Dims past ``len(layout.dims)`` are whole. The planning functions here are pure functions of
(layout, full shape, axis sizes, coordinate); ``shard.py`` turns them into tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import torch

from .mesh import Mesh
from .numbers import is_int

__all__ = [
    "Block",
    "Shard",
    "Cyclic",
    "Layout",
    "LayoutError",
    "replicated",
    "sharded",
    "fused",
    "cyclic",
    "dim_pieces",
    "local_pieces",
    "full_length",
]


MAX_DIMS = 64  # the most dims a layout describes (``with_dim`` pads with whole dims up to the one it sets)


class LayoutError(ValueError):
    """A layout that does not fit its tensor or mesh; the message names path, dim, sizes and axis."""


@dataclass(frozen=True, slots=True)
class Block:
    """A named block of a fused dim.

    Attributes:
        name: e.g. "q", "k", "v", "gate", "up".
        size: logical length of the block along the dim.
        unit: a shard holds whole units (e.g. ``head_dim``), so ``size // unit`` is the unit count.
        replicate: if the axis has more ranks than units, replicate each unit on
            ``axis_size // units`` consecutive ranks (vLLM's KV-head replication).
    """

    name: str
    size: int
    unit: int = 1
    replicate: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Block: name must be a non-empty str such as 'q', got {self.name!r}")
        if not is_int(self.size, 0) or not is_int(self.unit, 1):
            raise ValueError(
                f"Block {self.name!r}: size must be an int >= 0 and unit an int >= 1 (a head's width), got size "
                f"{self.size!r}, unit {self.unit!r}"
            )

    def __repr__(self) -> str:
        extra = (f"/{self.unit}" if self.unit != 1 else "") + ("~rep" if self.replicate else "")
        return f"{self.name}:{self.size}{extra}"


@dataclass(frozen=True, slots=True)
class Shard:
    """The dim is cut into contiguous pieces over ``axes`` (see the module docstring)."""

    axes: tuple[str, ...]
    blocks: tuple[Block, ...] = ()
    pack: int = 1
    groups: int = 1
    group_size: int = 1

    def __post_init__(self) -> None:  # accept "tp" and lists; store hashable tuples
        object.__setattr__(self, "axes", _axes(self.axes))
        object.__setattr__(self, "blocks", tuple(self.blocks))
        for name in ("pack", "groups", "group_size"):
            if not is_int(getattr(self, name), 1):
                raise ValueError(f"Shard: {name} must be a positive int, got {getattr(self, name)!r}")
        bad = [b for b in self.blocks if not isinstance(b, Block)]
        if bad:
            raise TypeError(f"Shard: blocks must be Blocks such as Block('q', 4096, 128), got {bad[0]!r}")

    @property
    def stored_unit(self) -> int:
        """Logical elements per stored element: ``pack * group_size``."""
        return self.pack * self.group_size

    def __repr__(self) -> str:
        parts = [",".join(self.axes)]
        if self.blocks:
            parts.append("[" + "|".join(map(repr, self.blocks)) + "]")
        if self.pack != 1:
            parts.append(f"pack={self.pack}")
        if self.groups != 1:
            parts.append(f"groups={self.groups}")
        if self.group_size != 1:
            parts.append(f"group_size={self.group_size}")
        return "shard(" + " ".join(parts) + ")"


@dataclass(frozen=True, slots=True)
class Cyclic:
    """A stacked layer dim of ``size`` layers; layer ``l`` lives on coordinate ``(l + offset) % n`` of ``axis``.

    ``Cyclic(axis, 1, offset=c)`` is a leaf held by coordinate ``c`` alone (a pipeline stage's embedding).
    """

    axis: str
    size: int
    offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str):
            raise ValueError(f"Cyclic: axis must be one mesh axis name such as 'pp', got {self.axis!r}")
        _axes(self.axis)
        if not is_int(self.size, 1):
            raise ValueError(f"Cyclic: size (the stacked layers) must be a positive int, got {self.size!r}")

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def __repr__(self) -> str:
        return f"cyclic({self.axis}, {self.size} layers" + (f", offset {self.offset})" if self.offset else ")")


DimSpec = Union[Shard, Cyclic]


@dataclass(frozen=True, slots=True)
class Layout:
    """Placement of one leaf: ``dims[d]`` is a :class:`Shard`, a :class:`Cyclic` or None (whole)."""

    dims: tuple[DimSpec | None, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.dims, str):
            raise TypeError(f"Layout: dims must be a sequence of Shard, Cyclic or None, got {self.dims!r}")
        object.__setattr__(self, "dims", tuple(self.dims))
        bad = [d for d in self.dims if d is not None and not isinstance(d, (Shard, Cyclic))]
        if bad:
            raise TypeError(
                f"Layout: each dim is a Shard, a Cyclic or None, got {bad[0]!r}; build one with sharded(0, 'tp'), "
                f"fused(...), cyclic(...) or replicated()"
            )

    def with_dim(self, dim: int, spec: DimSpec | None) -> Layout:
        """This layout with ``dims[dim]`` set (dims in between stay whole)."""
        if not is_int(dim, 0) or dim >= MAX_DIMS:
            raise LayoutError(f"layout dims are non-negative ints below {MAX_DIMS}, got {dim!r}")
        dims = list(self.dims) + [None] * (dim + 1 - len(self.dims))
        dims[dim] = spec
        while dims and dims[-1] is None:
            dims.pop()
        return Layout(tuple(dims))

    def axes(self) -> tuple[str, ...]:
        """Every mesh axis this layout uses, in dim order."""
        return tuple([a for d in self.dims if d is not None for a in d.axes])

    @property
    def is_replicated(self) -> bool:
        return all(d is None for d in self.dims)

    def __repr__(self) -> str:
        if self.is_replicated:
            return "replicated()"
        return "Layout(" + ", ".join(f"dim{i}={d!r}" for i, d in enumerate(self.dims) if d is not None) + ")"


# ---- constructors ---------------------------------------------------------------------------
def _axes(axes: str | Sequence[str]) -> tuple[str, ...]:
    out = (axes,) if isinstance(axes, str) else tuple(axes) if isinstance(axes, (list, tuple)) else None
    if not out or not all(isinstance(a, str) and a.isidentifier() for a in out):
        raise ValueError(f"a layout's mesh axes are axis names such as 'tp' or ('dp', 'tp'), got {axes!r}")
    return out


def replicated() -> Layout:
    """Every rank holds the whole tensor."""
    return Layout()


def sharded(dim: int, axes: str | Sequence[str], *, pack: int = 1) -> Layout:
    """Dim ``dim`` cut evenly over ``axes``; e.g. ``sharded(0, "tp")`` is column-parallel for a ``[out, in]`` weight."""
    return Layout().with_dim(dim, Shard(_axes(axes), (), pack))


def fused(
    dim: int,
    blocks: Sequence[Block | tuple[str, int]],
    axes: str | Sequence[str],
    *,
    pack: int = 1,
    groups: int = 1,
) -> Layout:
    """Dim ``dim`` is the concatenation of ``blocks``, each cut over ``axes`` on its own.

    With ``groups=G`` the stored dim is instead G interleaved groups (group ``g`` = every block's
    g-th 1/G slice, in block order), cut contiguously over ``axes``: Megatron's grouped QKV is
    ``fused(0, qkv_blocks, "tp", groups=num_kv_heads)``. Pieces still address the canonical
    ``[q|k|v]`` order, so ``shard``/``gather``/``reshard`` convert between the two orders.

    Example (Llama QKV with 32 heads, 8 KV heads, head_dim 128, tp up to 32):
        >>> fused(0, [Block("q", 4096, 128), Block("k", 1024, 128, True), Block("v", 1024, 128, True)], "tp")
        Layout(dim0=shard(tp [q:4096/128|k:1024/128~rep|v:1024/128~rep]))
    """
    bl = tuple(b if isinstance(b, Block) else Block(*b) for b in blocks)
    return Layout().with_dim(dim, Shard(_axes(axes), bl, pack, groups))


def cyclic(dim: int, axis: str, size: int, *, offset: int = 0) -> Layout:
    """A stacked dim of ``size`` layers; layer ``l`` is held only by coordinate ``(l + offset) % n`` of ``axis``."""
    return Layout().with_dim(dim, Cyclic(axis, size, offset))


# ---- validation -----------------------------------------------------------------------------
MAX_SIZE = 2**63  # a tensor dim's sizes are int64


def check_shape(shape: object, where: str) -> None:
    """One line (starting with ``where``, e.g. ``"local_shape: w's shape"``) for a shape that is not a sequence of
    ints in ``[0, 2**63)``: a str or a negative size once gave Python's own errors or a shard of negative length."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"{where} must be a sequence of ints such as (8, 4), got {shape!r}")
    bad = [n for n in shape if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < MAX_SIZE]
    if bad:
        raise ValueError(f"{where} {tuple(shape)} has size {bad[0]!r}; sizes are ints in [0, 2**63) (a tensor's shape)")


def validate(
    path: str,
    layout: object,
    shape: Sequence[int],
    dtype: torch.dtype,
    mesh_shape: Mapping[str, int],
    *,
    local: bool = False,
) -> Layout:
    """Check ``layout`` against a leaf of ``shape`` (full, or local if ``local``) and the mesh axes.

    Raises:
        TypeError / LayoutError naming the path, dim, sizes, mesh axis and a fix.
    """
    where = f"specs[{path!r}]"
    if not isinstance(layout, Layout):
        raise TypeError(
            f"{where} is {layout!r} ({type(layout).__name__}); "
            f"expected a Layout such as replicated() or sharded(0, 'tp')"
        )
    if len(layout.dims) > len(shape):
        raise LayoutError(
            f"{where} = {layout!r} describes {len(layout.dims)} dims but the tensor has {len(shape)} "
            f"(shape {tuple(shape)}); drop the trailing dims or fix the param"
        )
    seen: dict[str, int] = {}  # mesh axis -> the dim it shards
    for d, spec in enumerate(layout.dims):
        if spec is None:
            continue
        if not isinstance(spec, (Shard, Cyclic)):
            raise TypeError(f"{where} dim {d} is {spec!r}; expected Shard, Cyclic or None")
        _validate_axes(where, d, spec, mesh_shape, seen)
        if isinstance(spec, Shard):
            _validate_shard(where, d, spec, shape[d], dtype, math.prod([mesh_shape[a] for a in spec.axes]), local)
        else:
            _validate_cyclic(where, d, spec, shape, local)
    return layout


def _validate_axes(where: str, d: int, spec: DimSpec, mesh_shape: Mapping[str, int], seen: dict[str, int]) -> None:
    """Dim ``d``'s axes are mesh axes, none already sharding another dim (recorded in ``seen``)."""
    for a in spec.axes:
        if a not in mesh_shape:
            raise LayoutError(
                f"{where} dim {d} uses mesh axis {a!r}, which the mesh "
                f"{dict(mesh_shape)} does not have; use one of {list(mesh_shape)}"
            )
        if a in seen:
            raise LayoutError(
                f"{where} uses mesh axis {a!r} on dim {seen[a]} and dim {d}; an axis can shard one dim only"
            )
        seen[a] = d


def _validate_cyclic(where: str, d: int, spec: Cyclic, shape: Sequence[int], local: bool) -> None:
    if not isinstance(spec.offset, int) or isinstance(spec.offset, bool):
        raise LayoutError(
            f"{where} dim {d}: cyclic offset must be an int (the coordinate holding layer 0), got {spec.offset!r}"
        )
    if not local and shape[d] != spec.size:
        raise LayoutError(
            f"{where} dim {d} is cyclic over {spec.size} layers but the "
            f"tensor has {shape[d]} (shape {tuple(shape)}); set size={shape[d]}"
        )


def _validate_shard(where: str, d: int, spec: Shard, length: int, dtype: torch.dtype, n: int, local: bool) -> None:
    axis = ",".join(spec.axes)
    if spec.pack != 1:
        if not isinstance(spec.pack, int) or spec.pack < 1:
            raise LayoutError(f"{where} dim {d}: pack factor must be a positive int, got {spec.pack!r}")
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise LayoutError(
                f"{where} dim {d} is packed by {spec.pack} but the tensor dtype is {dtype}; "
                f"packed weights are stored in an integer dtype (e.g. torch.int32 for 8 int4 values)"
            )
    if spec.group_size != 1 and not (isinstance(spec.group_size, int) and spec.group_size > 1):
        raise LayoutError(f"{where} dim {d}: group_size must be a positive int, got {spec.group_size!r}")
    if spec.groups != 1 and not spec.blocks:
        raise LayoutError(
            f"{where} dim {d} has groups={spec.groups} but no blocks; "
            f"groups interleave fused blocks, e.g. fused(0, [q, k, v], {axis!r}, groups=num_kv_heads)"
        )
    if not spec.blocks:
        if local:
            return
        if length % n:
            if spec.group_size > 1:
                raise LayoutError(
                    f"{where} dim {d} holds {length} groups of {spec.group_size} (logical size "
                    f"{length * spec.stored_unit}) sharded over mesh axis {axis!r} (size {n}): {n} does not divide "
                    f"{length}, so a shard would cut a group; use an axis size that divides {length}, or a group "
                    f"size that divides each shard's {length * spec.stored_unit // n} values"
                )
            packed = f" packed units (pack {spec.pack})" if spec.pack > 1 else ""
            raise LayoutError(
                f"{where} shards dim {d} (size {length}{packed}) over mesh axis {axis!r} (size {n}): "
                f"{n} does not divide {length}; pad the weight or use an axis size that divides it"
            )
        return
    total = sum([b.size for b in spec.blocks])
    if not local and total != length * spec.stored_unit:
        raise LayoutError(
            f"{where} dim {d} is fused from blocks {list(spec.blocks)} of total size {total} but the tensor "
            f"dim is {length * spec.stored_unit}{' logical' if spec.stored_unit > 1 else ''}; fix the block sizes"
        )
    if spec.groups != 1:
        _grouped_pieces(where, d, axis, spec, n, 0)  # raises if the groups do not fit
        return
    for b in spec.blocks:
        _block_pieces(where, d, axis, b, 0, n, 0, spec)  # raises if no coordinate can be placed


# ---- planning -------------------------------------------------------------------------------
Piece = tuple[int, int, int]  # (start, stop, step) along the dim, in stored units


def _block_pieces(where: str, d: int, axis: str, b: Block, offset: int, n: int, c: int, spec: Shard) -> Piece:
    if b.size < 1 or b.unit < 1 or b.size % b.unit:
        raise LayoutError(
            f"{where} dim {d} block {b.name!r}: size {b.size} must be a positive multiple of its unit {b.unit}"
        )
    units = b.size // b.unit
    if units % n == 0:
        start, length = offset + c * (b.size // n), b.size // n
    elif b.replicate and n % units == 0:
        start, length = offset + (c // (n // units)) * b.unit, b.unit
    else:
        rule = (
            f"either {n} divides {units} or {units} divides {n} (then each unit is replicated on {n}//{units} ranks)"
            if b.replicate
            else f"{n} must divide {units}"
        )
        raise LayoutError(
            f"{where} dim {d} block {b.name!r} has {units} units of {b.unit} (size {b.size}) sharded over mesh "
            f"axis {axis!r} (size {n}): {rule}; use an axis size that fits"
            + ("" if b.replicate else " or mark the block replicate=True (KV heads)")
        )
    unit = spec.stored_unit
    if start % unit or length % unit:
        what = " x ".join(
            [f"pack {spec.pack}"] * (spec.pack > 1) + [f"group size {spec.group_size}"] * (spec.group_size > 1)
        )
        raise LayoutError(
            f"{where} dim {d} block {b.name!r}: the shard at logical [{start}, {start + length}) on coordinate {c} "
            f"of mesh axis {axis!r} (size {n}) does not fall on a stored-element boundary ({what}); use an axis "
            f"size whose shards are multiples of {unit}"
        )
    return (start // unit, (start + length) // unit, 1)


def _grouped_pieces(where: str, d: int, axis: str, spec: Shard, n: int, c: int) -> list[Piece]:
    g_count = spec.groups
    if not isinstance(g_count, int) or g_count < 1 or g_count % n:
        raise LayoutError(
            f"{where} dim {d} has {g_count} interleaved groups sharded over mesh axis {axis!r} (size {n}): "
            f"{n} must divide {g_count}; use an axis size that divides the group count (num_kv_heads)"
        )
    pieces: list[Piece] = []
    per = g_count // n
    for g in range(c * per, (c + 1) * per):
        offset = 0
        for b in spec.blocks:
            part = b.size // g_count
            unit = spec.stored_unit
            if b.size % (g_count * b.unit) or part % unit:
                raise LayoutError(
                    f"{where} dim {d} block {b.name!r} (size {b.size}, unit {b.unit}) cannot be cut into {g_count} "
                    f"groups of whole units on a stored-element boundary (pack {spec.pack}, group size "
                    f"{spec.group_size}); fix groups= or the block sizes"
                )
            start = offset + g * part
            pieces.append((start // unit, (start + part) // unit, 1))
            offset += b.size
    return pieces


def dim_pieces(spec: DimSpec, full_len: int, n: int, c: int, where: str = "spec", d: int = 0) -> list[Piece]:
    """The pieces of a full dim of ``full_len`` (stored units) held by coordinate ``c`` of an axis of size ``n``.

    The local dim is the concatenation of these pieces, in order. Pure; used for every rank.
    """
    if isinstance(spec, Cyclic):
        first = (c - spec.offset) % n
        return [(first, full_len, n)] if first < full_len else []
    if not spec.blocks:
        per = full_len // n
        return [(c * per, (c + 1) * per, 1)]
    if spec.groups != 1:
        return _grouped_pieces(where, d, ",".join(spec.axes), spec, n, c)
    pieces: list[Piece] = []
    offset = 0
    for b in spec.blocks:
        start, stop, step = _block_pieces(where, d, ",".join(spec.axes), b, offset, n, c, spec)
        if pieces and pieces[-1][1] == start and pieces[-1][2] == 1:
            pieces[-1] = (pieces[-1][0], stop, 1)  # merge touching pieces
        else:
            pieces.append((start, stop, step))
        offset += b.size
    return pieces


def local_pieces(path: str, layout: Layout, full_shape: Sequence[int], mesh: Mesh) -> list[list[Piece] | None]:
    """Per dim of ``layout``: the pieces of the full dim this mesh coordinate holds (None for a whole dim)."""
    out: list[list[Piece] | None] = []
    for d, spec in enumerate(layout.dims):
        if spec is None:
            out.append(None)
        else:
            n = mesh.axis_size(spec.axes)
            out.append(dim_pieces(spec, full_shape[d], n, mesh.axis_index(spec.axes), f"specs[{path!r}]", d))
    return out


def piece_len(p: Piece) -> int:
    return len(range(*p))


def full_length(spec: DimSpec, local_len: int, n: int) -> int:
    """The full (stored-unit) length of a dim from the layout and a local length (for ``gather``)."""
    if isinstance(spec, Cyclic):
        return spec.size
    if spec.blocks:
        return sum([b.size for b in spec.blocks]) // spec.stored_unit
    return local_len * n
