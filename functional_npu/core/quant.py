"""Quantized weights as data: the stored tensors of a quantized linear, their layouts, and the
reference quantization that writes them.

A quantized linear ``[out, in]`` is a small tree instead of one tensor, under compressed-tensors'
names (what llm-compressor writes and vLLM reads):

- ``weight``: int8 ``[out, in]`` (compressed-tensors' ``int-quantized`` and ``naive-quantized``), or
  ``weight_packed``: int32 words packed along ``in`` (``pack-quantized``, the only form at 4 bits; at
  8 bits what it writes for weight-only schemes): ``32 // bits`` values a word, value ``i`` of word ``j`` in bits
  ``[bits * i, bits * (i + 1))``, stored unsigned as ``q + 2**(bits - 1)``: ``[out, in * bits // 32]``;
- ``weight_scale``: per tensor ``[blocks]`` (one per logical matrix of a fused leaf: ``[q|k|v]``
  has three, ``[gate|up]`` two), per channel ``[out, 1]``, per group ``[out, in // G]``, per block
  ``[out // Bo, in // Bi]``;
- ``weight_zero_point``, asymmetric schemes only (per channel or group): signed zero points, int8,
  or packed like the weight but along ``out``: ``[out * bits // 32, 1 or in // G]``.

Any leading dims (experts, stacked layers) come first and are shared by all three. :class:`Quant`
names a scheme. :func:`quant_layouts` derives each stored tensor's layout from the float weight's
layout: packed dims get the pack factor, group and block dims the group size, and the fused
blocks of the ``out`` dim carry over, so ``shard``, ``gather`` and ``reshard`` place them like any
other leaf, and a group or packed word that a shard would cut fails validation naming the leaf,
dim, sizes and mesh axis. :func:`quantize` and :func:`dequantize` are the reference:
compressed-tensors' rounding (symmetric scale ``absmax / ((2**bits - 1) / 2)``, round half to
even) and packing, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import Block, Cyclic, Layout, LayoutError, Shard

__all__ = ["Quant", "quant_layouts", "quant_shapes", "quantize", "dequantize", "pack_int32", "unpack_int32"]

STRATEGIES = ("tensor", "channel", "group", "block")


@dataclass(frozen=True, slots=True)
class Quant:
    """A weight quantization scheme.

    Attributes:
        bits: 8 or 4.
        strategy: ``"tensor"``, ``"channel"``, ``"group"`` or ``"block"``: what one scale covers.
        group_size: values of ``in`` per scale, for ``"group"``.
        block: ``(Bo, Bi)`` rows and columns per scale, for ``"block"``.
        symmetric: no zero points; else a zero point per scale (``"channel"`` and ``"group"`` only).
        activations: ``"token"`` for dynamic per-token int8 activations (W8A8), None for weight-only.
        packed: values packed into int32 words (compressed-tensors' ``pack-quantized``); default: at
            4 bits only (int4 has no unpacked form here).
    """

    bits: int = 8
    strategy: str = "channel"
    group_size: int | None = None
    block: tuple[int, int] | None = None
    symmetric: bool = True
    activations: str | None = None
    packed: bool | None = None

    def __post_init__(self) -> None:
        if self.packed is None:
            object.__setattr__(self, "packed", self.bits < 8)
        if self.bits not in (4, 8) or isinstance(self.bits, bool):
            raise ValueError(f"Quant: bits must be 4 or 8, got {self.bits!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"Quant: strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.strategy == "group" and not (isinstance(self.group_size, int) and self.group_size > 0):
            raise ValueError(f"Quant: strategy 'group' needs a positive int group_size, got {self.group_size!r}")
        if self.strategy != "group" and self.group_size is not None:
            raise ValueError(f"Quant: group_size {self.group_size} is for strategy 'group', not {self.strategy!r}")
        if self.strategy == "block" and not (
            isinstance(self.block, tuple)
            and len(self.block) == 2
            and all(isinstance(b, int) and b > 0 for b in self.block)
        ):
            raise ValueError(f"Quant: strategy 'block' needs block=(rows, cols) of positive ints, got {self.block!r}")
        if self.strategy != "block" and self.block is not None:
            raise ValueError(f"Quant: block {self.block} is for strategy 'block', not {self.strategy!r}")
        if not self.symmetric and self.strategy not in ("channel", "group"):
            raise ValueError(
                f"Quant: zero points (symmetric=False) exist for 'channel' and 'group', not {self.strategy!r}"
            )
        if not self.packed and self.bits < 8:
            raise ValueError("Quant: 4-bit weights are stored packed (packed=True), eight to an int32 word")
        if self.activations not in (None, "token"):
            raise ValueError(
                f"Quant: activations must be None or 'token' (dynamic per-token), got {self.activations!r}"
            )

    @property
    def pack(self) -> int:
        """Values per stored element of ``weight`` along ``in`` (and of ``weight_zero_point`` along ``out``)."""
        return 32 // self.bits if self.packed else 1

    @property
    def weight_name(self) -> str:
        """The stored name of the quantized values: ``weight_packed`` when packed, else ``weight``."""
        return "weight_packed" if self.packed else "weight"

    @property
    def storage(self) -> torch.dtype:
        return torch.int32 if self.packed else torch.int8

    def __repr__(self) -> str:
        what = self.strategy
        if self.strategy == "group":
            what = f"group {self.group_size}"
        elif self.strategy == "block":
            what = f"block {self.block[0]}x{self.block[1]}"
        extra = ("" if self.symmetric else ", asymmetric") + (
            ", int8 activations per token" if self.activations else ""
        )
        return f"Quant(int{self.bits}, {what}{extra})"


def _check_quant_layout(layout: Layout, quant: Quant, ndim: int) -> None:
    """One line for arguments :func:`quant_layouts` cannot derive stored layouts from."""
    if not isinstance(layout, Layout):
        raise TypeError(f"quant_layouts: layout must be a Layout such as sharded(0, 'tp'), got {layout!r}")
    if not isinstance(quant, Quant):
        raise TypeError(f"quant_layouts: quant must be a Quant such as Quant(8), got {quant!r}")
    if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 2:
        raise ValueError(
            f"quant_layouts: ndim must be an int >= 2 (a quantized linear's weight is [..., out, in]), got {ndim!r}"
        )
    past = [d for d, spec in enumerate(layout.dims) if d >= ndim and spec is not None]
    if past:
        raise LayoutError(
            f"quant_layouts: {layout!r} places dim {past[0]}, past a weight of ndim {ndim} (dims 0..{ndim - 1}); "
            f"give the weight's ndim, or a layout of its dims"
        )


def _dims(layout: Layout, ndim: int) -> list:
    dims = list(layout.dims) + [None] * (ndim - len(layout.dims))
    for d in (ndim - 2, ndim - 1):
        if isinstance(dims[d], Cyclic):
            raise LayoutError(f"a quantized weight's out and in dims cannot be cyclic (dim {d} is {dims[d]!r})")
    return dims


def _coarser(spec: Shard | None, *, pack: int = 1, group: int = 1) -> Shard | None:
    """``spec`` for a dim whose stored element stands for ``pack`` packed values or a group of ``group``."""
    if spec is None:
        return None
    return Shard(spec.axes, spec.blocks, spec.pack * pack, spec.groups, spec.group_size * group)


def _layout(dims: list) -> Layout:
    while dims and dims[-1] is None:
        dims = dims[:-1]
    return Layout(tuple(dims))


def quant_layouts(layout: Layout, quant: Quant, ndim: int = 2) -> dict[str, Layout]:
    """The layouts of a quantized linear's stored tensors, from its float weight's ``layout`` (a weight
    of ``ndim`` dims whose last two are ``[out, in]``).

    Example (row-parallel down_proj, int4 with groups of 128):
        >>> quant_layouts(sharded(1, "tp"), Quant(4, "group", group_size=128))["weight_scale"]
        Layout(dim1=shard(tp group_size=128))
    """
    _check_quant_layout(layout, quant, ndim)
    dims = _dims(layout, ndim)
    lead, out, inn = dims[: ndim - 2], dims[ndim - 2], dims[ndim - 1]
    q = quant
    tree = {q.weight_name: _layout(lead + [out, _coarser(inn, pack=q.pack)])}
    if q.strategy == "tensor":
        tree["weight_scale"] = _layout(lead + [None])
    elif q.strategy == "channel":
        tree["weight_scale"] = _layout(lead + [out, None])
    elif q.strategy == "group":
        tree["weight_scale"] = _layout(lead + [out, _coarser(inn, group=q.group_size)])
    else:
        rows, cols = q.block
        tree["weight_scale"] = _layout(lead + [_coarser(out, group=rows), _coarser(inn, group=cols)])
    if not q.symmetric:
        zin = None if q.strategy == "channel" else _coarser(inn, group=q.group_size)
        tree["weight_zero_point"] = _layout(lead + [_coarser(out, pack=q.pack), zin])
    return tree


def quant_shapes(shape: Sequence[int], quant: Quant, blocks: int = 1) -> dict[str, tuple[int, ...]]:
    """The stored shapes of a quantized weight of float ``shape`` (``[..., out, in]``; ``blocks`` logical
    matrices fused along ``out``, for per-tensor scales). Raises ValueError naming the dim that a pack
    factor, group or block does not divide."""
    *lead, out, inn = shape
    q = quant

    def div(n: int, by: int, what: str) -> int:
        if n % by:
            raise ValueError(f"a quantized weight of shape {tuple(shape)}: {what} {by} does not divide {n}")
        return n // by

    packing = f"the pack factor (int{q.bits} values per int32)"
    shapes = {q.weight_name: (*lead, out, div(inn, q.pack, f"{packing} along in"))}
    if q.strategy == "tensor":
        shapes["weight_scale"] = (*lead, blocks)
    elif q.strategy == "channel":
        shapes["weight_scale"] = (*lead, out, 1)
    elif q.strategy == "group":
        shapes["weight_scale"] = (*lead, out, div(inn, q.group_size, "the group size along in"))
    else:
        rows, cols = q.block
        shapes["weight_scale"] = (
            *lead,
            div(out, rows, "the block rows along out"),
            div(inn, cols, "the block columns along in"),
        )
    if not q.symmetric:
        groups = 1 if q.strategy == "channel" else shapes["weight_scale"][-1]
        shapes["weight_zero_point"] = (*lead, div(out, q.pack, f"{packing} along out (zero points)"), groups)
    return shapes


# ---- packing ---------------------------------------------------------------------------------
def pack_int32(q: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Signed ``bits``-bit values (int8 tensor) packed ``32 // bits`` to an int32 word along ``dim``,
    least significant first, each stored unsigned as ``q + 2**(bits - 1)`` (compressed-tensors' packing)."""
    per = 32 // bits
    x = q.movedim(dim, -1)
    if x.shape[-1] % per:
        raise ValueError(f"pack_int32: dim {dim} of length {x.shape[-1]} is not a multiple of {per} values per word")
    u = (x.to(torch.int64) + (1 << (bits - 1))).unflatten(-1, (-1, per))
    word = (u << (torch.arange(per, dtype=torch.int64) * bits)).sum(-1)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)  # two's complement: the top value's bit is the sign
    return word.to(torch.int32).movedim(-1, dim)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """The inverse of :func:`pack_int32`: signed values as int8."""
    per = 32 // bits
    x = packed.movedim(dim, -1)
    u = (x.unsqueeze(-1) >> (torch.arange(per, dtype=torch.int32) * bits)) & ((1 << bits) - 1)
    return (u.flatten(-2) - (1 << (bits - 1))).to(torch.int8).movedim(-1, dim)


# ---- the reference quantization ---------------------------------------------------------------
def _reduce(w: torch.Tensor, quant: Quant, blocks: Sequence[Block] | None, largest: bool) -> torch.Tensor:
    """The max (or min) of ``w`` ([..., out, in]) over what each scale covers, in the scale's stored shape."""
    q = quant
    pick = torch.amax if largest else torch.amin
    if q.strategy == "channel":
        return pick(w, -1, keepdim=True)  # [..., out, 1]
    if q.strategy == "group":
        return pick(w.unflatten(-1, (-1, q.group_size)), -1)  # [..., out, in/G]
    if q.strategy == "block":
        rows, cols = q.block
        return pick(w.unflatten(-2, (-1, rows)).unflatten(-1, (-1, cols)), (-3, -1))  # [..., out/Bo, in/Bi]
    sizes = [b.size for b in blocks] if blocks else [w.shape[-2]]
    return torch.stack([pick(part, (-2, -1)) for part in w.split(sizes, dim=-2)], -1)  # [..., blocks]


def _expand(s: torch.Tensor, w_shape: Sequence[int], quant: Quant, blocks: Sequence[Block] | None) -> torch.Tensor:
    """A per-scale tensor (``weight_scale`` or zero points, unpacked) broadcast to the weight's shape."""
    *lead, out, inn = w_shape
    q = quant
    if q.strategy == "channel":
        return s.reshape(*lead, out, 1).expand(*lead, out, inn)
    if q.strategy == "group":
        return s.repeat_interleave(q.group_size, -1)
    if q.strategy == "block":
        rows, cols = q.block
        return s.repeat_interleave(rows, -2).repeat_interleave(cols, -1)
    sizes = torch.tensor([b.size for b in blocks] if blocks else [out])
    return s.repeat_interleave(sizes, -1).unsqueeze(-1).expand(*lead, out, inn)


def quantize(
    w: torch.Tensor, quant: Quant, *, blocks: Sequence[Block] | None = None, scale_dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The stored tensors of ``w`` (``[..., out, in]``, float) under ``quant``, as compressed-tensors writes
    them. ``blocks``: the logical matrices fused along ``out`` (one scale each, for per-tensor scales);
    scales in ``scale_dtype`` (default: ``w``'s dtype)."""
    q = quant
    shapes = quant_shapes(w.shape, q, len(blocks) if blocks else 1)
    scale_dtype = scale_dtype or w.dtype
    x = w.float()
    levels = (1 << q.bits) - 1
    lo, hi = -(1 << (q.bits - 1)), (1 << (q.bits - 1)) - 1
    tiny = torch.finfo(torch.float32).eps
    if q.symmetric:  # fp32 statistics, as compressed-tensors' observers keep them
        scale32 = (_reduce(x.abs(), q, blocks, True) / (levels / 2)).clamp(min=tiny)
        zero = None
    else:  # the range widened to hold 0, then the zero point that maps its min to the lowest level
        mn, mx = _reduce(x, q, blocks, False).clamp(max=0), _reduce(x, q, blocks, True).clamp(min=0)
        scale32 = ((mx - mn) / levels).clamp(min=tiny)
        zero = torch.clamp(torch.round(lo - mn / scale32), lo, hi)
    scale = scale32.to(scale_dtype)
    # the division runs in the weight's and scale's dtype, as compressed-tensors' quantize does
    dt = torch.promote_types(w.dtype, scale_dtype)
    scaled = w.to(dt) / _expand(scale, w.shape, q, blocks).to(dt)
    if zero is not None:
        scaled = scaled + _expand(zero, w.shape, q, blocks).to(dt)
    values = torch.clamp(torch.round(scaled), lo, hi).to(torch.int8)
    out = {q.weight_name: pack_int32(values, q.bits, -1) if q.packed else values}
    out["weight_scale"] = scale.reshape(shapes["weight_scale"])
    if zero is not None:
        z = zero.to(torch.int8)
        out["weight_zero_point"] = pack_int32(z, q.bits, -2) if q.packed else z
    return out


def dequantize(stored: dict[str, torch.Tensor], quant: Quant, *, blocks: Sequence[Block] | None = None) -> torch.Tensor:
    """The float weight of :func:`quantize`'s stored tensors: ``(q - zero_point) * scale`` in the scale's dtype."""
    q = quant
    values = unpack_int32(stored[q.weight_name], q.bits, -1) if q.packed else stored[q.weight_name]
    scale = stored["weight_scale"]
    shape = values.shape
    zero = stored.get("weight_zero_point")
    if zero is not None and q.packed:
        zero = unpack_int32(zero, q.bits, -2)
    full_s = _expand(scale, shape, q, blocks)
    full_z = 0 if zero is None else _expand(zero.to(scale.dtype), shape, q, blocks)
    return ((values.to(scale.dtype) - full_z) * full_s).to(scale.dtype)
