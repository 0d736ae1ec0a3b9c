"""A linear layer's matmul, chosen by what its weight leaf holds.

- a float tensor ``[out, in]``: ``x @ w.T``;
- ``{"streamed": w}``, the CPU's form of a float weight (:func:`prepare_dense`): under ``torch.compile`` a few
  rows (a decode step's batch: up to 8 in float32, one in other dtypes, :data:`STREAM_ROWS`) are one
  multiply-and-sum reduction per row that inductor fuses into one pass over the weight (:func:`streamed`), at
  80-90% of the memory's read bandwidth at one row where the CPU matmul reaches about half; more rows, and
  eager, take the matmul;
- a quantized weight prepared for the CPU kernels by :func:`prepare` (a dict; its keys name the form):

  - ``{"w8", "scale"}``: int8 weights with a scale per output channel, ``aten._weight_int8pack_mm``;
  - ``{"w4", "scales_zeros"}``: int4 weights with a scale (and zero) per group of inputs, in the
    kernel's own packing, ``aten._weight_int4pack_mm_for_cpu``;
  - ``{"w8a8", "scale"}``: int8 weights and int8 activations quantized per token as they arrive
    (W8A8), ``aten._int_mm`` with int32 accumulation, then both scales;

- a quantized weight prepared for Ascend's kernels (``prepare(..., target="npu")``), input-major as they
  take it, each called through a torch op that torchair converts to that kernel's GE op
  (:mod:`functional_npu.models.ascend_ops`):

  - ``{"qbmm", "scale"}``: W8A8, int8 ``[in, out]``, ``QuantBatchMatmulV3`` after the same per-token
    rounding as on CPU (compressed-tensors' ``absmax / 127.5``, written in aten ops GE converts; Ascend's
    ``DynamicQuant`` divides by 127, which would not reproduce the checkpoint's reference);
  - ``{"wqbmm", "scale"[, "offset"]}``: weight-only int8 ``[in, out]`` or int4 ``[in, out / 8]`` words with
    a scale (and offset) per channel ``[out]`` or per group ``[in / G, out]``, ``WeightQuantBatchMatmulV2``.

The stored form (:mod:`functional_npu.core.quant`: ``weight``, ``weight_scale``, ...) is what
layouts, loaders and resharding see; :func:`prepare` turns one local shard of it into a kernel's
form, once, after loading. The kernels take activations and scales in one dtype (bf16 is their fast
path on CPU; fp32 activations run far slower), so :func:`prepare` casts the scales to the dtype the
model computes in. A scheme no kernel covers (int8 group or block scales, int4 groups the kernel
does not take, output sizes it does not tile) is dequantized to a dense weight in that dtype:
correct, and as slow as a float model (with int8 activations, ``{"a8": weight}``: the activations are
still rounded per token). Per-tensor scales become per-channel ones (the same numbers).
Ascend's kernels take 16-bit activations only: with float32 ones, and for group sizes that are not a
multiple of 32, the NPU target dequantizes too; ``target="dense"`` always does (CUDA, whose int8 and
int4 kernels take other packings).

Experts stacked on dim 0 (``[S, out, in]``) have no CPU kernel: they are held as int8 values (int4
ones one to a byte) with their scales and zero points per group, ``{"q" | "q8a8", "scale"[, "zero"]}``,
and :func:`expert_weights` dequantizes the experts a token is routed to as they are read.
:func:`row_parallel` is a row-parallel linear over a tensor-parallel axis: with W8A8 each token's
int8 scale is taken over its whole row (a max over the axis), as in the unsharded model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..core.collectives import all_reduce
from ..core.mesh import Axes, Mesh
from ..core.params import Params
from ..core.quant import Quant, dequantize, unpack_int32
from .ascend_ops import pack_int4, quant_matmul, weight_quant_matmul

__all__ = [
    "linear",
    "row_parallel",
    "row_amax",
    "int8_activations",
    "token_amax",
    "int8_tokens",
    "prepare",
    "prepare_params",
    "prepare_dense",
    "stream_rows",
    "STREAM_ROWS",
    "TARGETS",
    "KINDS",
    "kernel_of",
    "expert_weights",
    "quantized_activations",
    "slot_count",
    "dense",
]

_GEMV_DTYPES = (torch.bfloat16, torch.float16)
# up to this many rows a CPU linear over a float32 weight is one pass over the weight (:func:`streamed`); other dtypes
# stream one row only: at 8 rows of bf16 the per-row reductions convert each weight element once per row and measured
# 2.3x slower than the matmul's bf16 kernel (44 against 19 ms a step, benchmarks/README.md)
STREAM_ROWS = {torch.float32: 8}
_INT4_GROUPS = (32, 64, 128, 256)  # what aten._weight_int4pack_mm_for_cpu takes
_INT4_TILE = 16  # it needs out_features divisible by this
_NPU_GROUP = 32  # WeightQuantBatchMatmulV2 takes group sizes that are multiples of this
TARGETS = ("cpu", "npu", "dense")  # whose kernels prepare() aims at
KINDS = ("w8", "w4", "w8a8", "qbmm", "wqbmm", "a8", "streamed")
_INT8_ACTIVATIONS = ("w8a8", "qbmm", "a8")


def kernel_of(w: Any) -> str:
    """The form of a weight leaf: ``"dense"`` or one of ``w8``, ``w4``, ``w8a8``, ``qbmm``, ``wqbmm``, ``a8``,
    ``streamed`` (the CPU's dense weight one row streams, :func:`streamed`)."""
    if isinstance(w, torch.Tensor):
        return "dense"
    for kind in KINDS:
        if kind in w:
            return kind
    raise TypeError(
        f"a linear weight is a tensor or a prepared quantized weight (keys {' / '.join(KINDS)}), "
        f"got keys {sorted(w)}; "
        f"stored quantized weights go through functional_npu.models.linear.prepare first"
    )


def dense(w: Any) -> torch.Tensor | None:
    """The dense tensor of a weight leaf (as it is, or in its ``streamed`` form), None for a quantized form."""
    if isinstance(w, torch.Tensor):
        return w
    return w["streamed"] if kernel_of(w) == "streamed" else None


def token_amax(x: torch.Tensor) -> torch.Tensor:
    """Each token's largest magnitude ``[..., 1]`` (float32): what its int8 scale is made of. (``max`` over a
    dim, not ``amax``: torchair has no GE converter for ``aten.amax``.)"""
    return x.abs().max(-1, keepdim=True).values.float()


def int8_tokens(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., in]`` as symmetric int8 per token, compressed-tensors' rule (scale ``amax / 127.5``, round half
    to even): ``(values int8, scale [..., 1] float32)``. ``amax``: each token's magnitude, if not ``x``'s own."""
    big = token_amax(x) if amax is None else amax
    scale = big.clamp(min=torch.finfo(torch.float32).eps) / 127.5
    return torch.clamp(torch.round(x.float() / scale), -128, 127).to(torch.int8), scale


def int8_activations(w: Any) -> bool:
    """Whether the weight's kernel rounds its activations to int8 per token (W8A8 forms)."""
    return kernel_of(w) in _INT8_ACTIVATIONS


def row_amax(x: torch.Tensor, w: Any, mesh: Mesh, axes: Axes) -> torch.Tensor | None:
    """For a row-parallel ``w`` with int8 activations (W8A8), each token's magnitude over its whole row, a max
    over ``axes`` (the ranks holding the row's slices); None otherwise (the kernel takes ``x``'s own)."""
    if int8_activations(w) and mesh.axis_size(axes) > 1:
        return all_reduce(token_amax(x), mesh, axes, op="max")
    return None


def row_parallel(x: torch.Tensor, w: Any, mesh: Mesh, tp: str) -> torch.Tensor:
    """A row-parallel linear: this rank's slice of the inputs times its slice of ``w``, summed over ``tp``.

    With int8 activations (W8A8) each token is rounded with the scale of its whole row, as in the
    unsharded model: the per-token magnitudes are reduced (max) over ``tp`` first.
    """
    return all_reduce(linear(x, w, amax=row_amax(x, w, mesh, tp)), mesh, tp)


def streamed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ w.T`` as one multiply-and-sum reduction over ``in`` per row of ``x``, in float32 (the matmul's
    accumulation). The reductions share their loop over the weight ``[out, in]``, so inductor fuses them into one
    pass that reads each weight element once and keeps one accumulator per row in registers: on the CPU a decode
    step's weights stream at 70-90% of a plain read's bandwidth at one row, and at 8 rows of float32 it runs
    1.6x faster than the CPU matmul (``benchmarks/README.md``). Rows are the batch: at most
    :func:`stream_rows` of them."""
    flat = x.reshape(-1, x.shape[-1])
    wide = w.float()
    y = torch.stack([(wide * flat[r].float()).sum(-1) for r in range(flat.shape[0])])  # [rows, out]
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def stream_rows(dtype: torch.dtype) -> int:
    """The most rows a ``streamed`` weight of ``dtype`` runs as :func:`streamed` (:data:`STREAM_ROWS`; else 1)."""
    return STREAM_ROWS.get(dtype, 1)


def _streams(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a ``streamed`` form runs as :func:`streamed`: at most :func:`stream_rows` rows, under ``torch.compile``
    (inductor generates the reductions; eager keeps the matmul, which is faster without fusion)."""
    return x.numel() <= stream_rows(w.dtype) * x.shape[-1] and torch.compiler.is_compiling()


def linear(x: torch.Tensor, w: Any, *, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in]`` times the weight ``[out, in]`` transposed: ``[..., out]``. ``amax``: W8A8 only, each
    token's magnitude ``[..., 1]`` to take its int8 scale from (default: ``x``'s own, :func:`token_amax`)."""
    kind = kernel_of(w)
    if kind == "dense":
        return x @ w.T
    if kind == "streamed":
        return streamed(x, w["streamed"]) if _streams(x, w["streamed"]) else x @ w["streamed"].T
    flat = x.reshape(-1, x.shape[-1])
    if kind in _INT8_ACTIVATIONS:  # W8A8: symmetric int8 per token (compressed-tensors' rule: absmax / 127.5)
        xq, x_scale = int8_tokens(flat, None if amax is None else amax.reshape(-1, 1))
    if kind == "w8":
        y = torch.ops.aten._weight_int8pack_mm(flat, w["w8"], w["scale"])
    elif kind == "w4":
        group = x.shape[-1] // w["scales_zeros"].shape[0]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, w["w4"], group, w["scales_zeros"])
    elif kind == "wqbmm":
        scale = w["scale"]
        group = x.shape[-1] // scale.shape[0] if scale.ndim == 2 else 0
        y = weight_quant_matmul(flat, w["wqbmm"], scale, w.get("offset"), group)
    elif kind == "a8":  # a dequantized weight, the activations rounded to int8 and back
        y = (xq * x_scale).to(x.dtype) @ w["a8"].T
    elif kind == "qbmm":
        y = quant_matmul(xq, w["qbmm"], w["scale"], x_scale.reshape(-1), x.dtype)
    else:  # w8a8: int32 accumulation, then both scales
        acc = torch.ops.aten._int_mm(xq, w["w8a8"].T)
        y = (acc.float() * x_scale * w["scale"].float()).to(x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def prepare(
    stored: dict[str, torch.Tensor],
    quant: Quant,
    dtype: torch.dtype,
    blocks: list[int] | None = None,
    target: str = "cpu",
) -> Any:
    """A kernel's form of one quantized weight (this rank's shard, as stored), for activations in ``dtype``;
    a dense ``dtype`` weight where no kernel covers the scheme (see the module docstring). ``blocks``: the
    local sizes along ``out`` of the matrices a per-tensor scale each covers (a fused leaf's q, k, v).
    ``target``: whose kernels (:data:`TARGETS`): ``"cpu"`` (torch's CPU kernels), ``"npu"`` (Ascend's, via
    :mod:`functional_npu.models.ascend_ops`) or ``"dense"``.

    Experts stacked on dim 0 (``[S, out, in]``) take the form :func:`expert_weights` reads."""
    if target not in TARGETS:
        raise ValueError(f"prepare: target {target!r} is not one of {TARGETS}")
    values = stored[quant.weight_name]
    if quant.strategy == "tensor":  # one scale per block: the same as a scale per channel, for kernels
        scale = stored["weight_scale"]
        sizes = torch.tensor(blocks or [values.shape[-2]])
        channel = scale.repeat_interleave(sizes, -1).unsqueeze(-1)  # [..., out, 1]
        stored, quant = stored | {"weight_scale": channel}, replace(quant, strategy="channel")
    if values.ndim == 3:
        return _experts(stored, quant, dtype)
    if target == "npu":
        return _ascend(stored, quant, dtype)
    out_features = values.shape[-2]
    if target == "cpu" and quant.bits == 8 and quant.strategy == "channel" and quant.symmetric:
        w8 = (unpack_int32(values, 8, -1) if quant.packed else values).contiguous()
        if quant.activations == "token":
            return {"w8a8": w8, "scale": stored["weight_scale"].reshape(-1).float()}
        return {"w8": w8, "scale": stored["weight_scale"].reshape(-1).to(dtype)}
    int4_tiles = out_features % _INT4_TILE == 0
    if target == "cpu" and quant.bits == 4 and quant.strategy in ("group", "channel") and int4_tiles:
        in_features = values.shape[-1] * quant.pack
        group = quant.group_size if quant.strategy == "group" else _channel_group(in_features)
        if group in _INT4_GROUPS and in_features % group == 0:
            return _int4(stored, quant, group, in_features, dtype)
    return _dense(stored, quant, dtype)


def _ascend(stored: dict[str, torch.Tensor], quant: Quant, dtype: torch.dtype) -> Any:
    """Ascend's form of one weight ``[out, in]`` (module docstring): ``qbmm`` for W8A8 per channel, ``wqbmm``
    for weight-only int8 / int4 per channel, group or block (a block's scale repeated over its rows is a
    group scale), sym or asym; else dense. Weights, scales and offsets are transposed to input-major."""
    q = quant
    values = unpack_int32(stored[q.weight_name], q.bits, -1) if q.packed else stored[q.weight_name]  # [out, in]
    out_features, in_features = values.shape
    scale = stored["weight_scale"]  # [out, 1] per channel, [out, in / G] per group, [out / B0, in / B1] per block
    group = {"channel": 0, "group": q.group_size, "block": q.block[1] if q.block else 0}.get(q.strategy)
    fits = (
        dtype in _GEMV_DTYPES
        and group is not None
        and (q.activations is None or (q.bits == 8 and q.strategy == "channel" and q.symmetric))
        and (group == 0 or (group % _NPU_GROUP == 0 and in_features % group == 0))
        and (q.bits == 8 or out_features % 8 == 0)
    )
    if not fits:
        return _dense(stored, quant, dtype)
    if q.activations == "token":
        return {"qbmm": values.T.contiguous(), "scale": scale.reshape(-1).float()}
    if q.strategy == "block":
        scale = scale.repeat_interleave(q.block[0], 0)[:out_features]
    weight = values.T.contiguous() if q.bits == 8 else pack_int4(values.T.contiguous())
    out = {"wqbmm": weight, "scale": _input_major(scale, group).to(dtype)}
    if not q.symmetric:  # zero points exist per channel or group only
        zero = stored["weight_zero_point"]
        zero = unpack_int32(zero, q.bits, -2)[:out_features] if q.packed else zero
        out["offset"] = -_input_major(zero, group).to(dtype)
    return out


def _dense(stored: dict[str, torch.Tensor], quant: Quant, dtype: torch.dtype) -> Any:
    """The dequantized weight in ``dtype``; with int8 activations (W8A8) ``{"a8": weight}``, so that the
    activations are still rounded per token as the scheme says."""
    w = dequantize(stored, quant).to(dtype)
    return {"a8": w} if quant.activations == "token" else w


def _input_major(per_out: torch.Tensor, group: int) -> torch.Tensor:
    """A scale or zero point ``[out, 1]`` (per channel: ``[out]``) or ``[out, in / G]`` -> ``[in / G, out]``."""
    return per_out.reshape(-1) if group == 0 else per_out.T.contiguous()


def _channel_group(in_features: int) -> int | None:
    """A kernel group size for per-channel int4 scales (each channel's scale repeated over its groups)."""
    return next((g for g in reversed(_INT4_GROUPS) if in_features % g == 0), None)


def _int4(stored: dict[str, torch.Tensor], quant: Quant, group: int, in_features: int, dtype: torch.dtype) -> dict:
    """int4 weights in ``aten._weight_int4pack_mm_for_cpu``'s packing (built by its own op: the byte layout
    depends on the CPU), with ``scales_zeros [in / group, out, 2]``: ``w = (u - 8) * scale + zero``, so an
    asymmetric zero point ``zp`` becomes ``zero = -zp * scale``."""
    unsigned = (unpack_int32(stored["weight_packed"], 4, -1).to(torch.int32) + 8).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 2)
    scale = stored["weight_scale"].float()  # [out, in / G], or [out, 1] per channel
    per = in_features // group // scale.shape[-1]  # kernel groups per stored scale
    scale = scale.repeat_interleave(per, -1)
    zero = torch.zeros_like(scale)
    if not quant.symmetric:
        zp = unpack_int32(stored["weight_zero_point"], 4, -2).float().repeat_interleave(per, -1)
        zero = -zp * scale
    scales_zeros = torch.stack([scale.T, zero.T], -1).to(dtype).contiguous()
    return {"w4": packed, "scales_zeros": scales_zeros}


def _experts(stored: dict[str, torch.Tensor], quant: Quant, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Experts ``[S, out, in]`` as int8 values, a ``dtype`` scale per group of inputs ``[S, out, in / G]`` and,
    if asymmetric, int8 zero points of the same shape: dequantized per expert as :func:`expert_weights` picks
    them (no CPU kernel takes a stack of weights; int4 values are held one to a byte). With dynamic int8
    activations (W8A8) the key is ``q8a8`` and the activations are rounded per token as the kernel would."""
    q = quant
    values = unpack_int32(stored[q.weight_name], q.bits, -1) if q.packed else stored[q.weight_name]
    scale = stored["weight_scale"]
    if q.strategy == "block":  # one scale per block of rows: per row, for the dequantizing matmul
        scale = scale.repeat_interleave(q.block[0], -2)
    out = {"q8a8" if q.activations else "q": values.contiguous(), "scale": scale.to(dtype).contiguous()}
    if not q.symmetric:
        zero = stored["weight_zero_point"]
        out["zero"] = (unpack_int32(zero, q.bits, -2) if q.packed else zero).contiguous()
    return out


def expert_weights(w: Any, index: torch.Tensor | None = None) -> torch.Tensor:
    """The dense weights of a stack of experts (``[S, out, in]``), or of those at ``index`` (``w[index]``)."""
    if isinstance(w, torch.Tensor):
        return w if index is None else w[index]
    values = w["q"] if "q" in w else w["q8a8"]
    scale, zero = w["scale"], w.get("zero")
    if index is not None:
        values, scale, zero = values[index], scale[index], None if zero is None else zero[index]
    x = values.to(scale.dtype)
    if zero is not None:
        x = x - zero.to(scale.dtype).repeat_interleave(x.shape[-1] // zero.shape[-1], -1)
    return x * scale.repeat_interleave(x.shape[-1] // scale.shape[-1], -1)


def slot_count(w: Any) -> int:
    """The number of experts in a stack (dense or quantized)."""
    return w.shape[0] if isinstance(w, torch.Tensor) else w["scale"].shape[0]


def quantized_activations(x: torch.Tensor, w: Any, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` rounded to int8 per token and back (W8A8 experts: what the int8 matmul sees); else ``x``.
    ``amax``: each row's magnitude to take the scale from (default: ``x``'s own)."""
    if isinstance(w, torch.Tensor) or "q8a8" not in w:
        return x
    values, scale = int8_tokens(x, amax)
    return (values * scale).to(x.dtype)


def prepare_dense(w: torch.Tensor, target: str = "cpu") -> Any:
    """A dense linear weight ``[out, in]`` in the form its kernel streams: on the CPU ``{"streamed": w}``, row-major
    (contiguous): a few rows run as :func:`streamed`, which reads each output row's weights in one run (a weight
    that arrives in another order, a transposed view from a training layout, is copied once); else ``w``,
    unchanged. Experts ``[S, out, in]`` stay as they are."""
    if target == "cpu" and w.ndim == 2 and w.device.type == "cpu":
        return {"streamed": w.contiguous()}
    return w


def prepare_params(
    params: dict[str, Any],
    quant: Any = None,
    blocks: Any = None,
    target: str = "cpu",
    linears: tuple[str, ...] = (),
) -> Params:
    """``params`` with every stored quantized leaf (a dict of ``weight``/``weight_packed``, ``weight_scale``,
    ...; see :mod:`functional_npu.placement.quant_layouts`) in its kernel's form for ``target`` (:func:`prepare`),
    for activations in the embedding's dtype, and every linear leaf named in ``linears`` in the form that
    streams fastest: on the CPU, dense leaves take their ``streamed`` form
    (:func:`prepare_dense`, values unchanged; ``linears`` empty: none, as ``compile_model`` asks for a model that
    is not compiled and for one whose layers arrive by broadcast within the step). Layer-sharded leaves
    (``series``) keep the plain forms.
    ``quant``: the checkpoint's quantization config (its ``quant``, the scheme), None for float weights;
    ``blocks(path) -> [local sizes]``: the blocks of a per-tensor scale. Pure."""
    qc = quant
    dtype = params["embed"].dtype
    if qc is None and not linears:
        return params

    def one(path: str, node: dict[str, torch.Tensor]) -> Any:
        tensor_blocks = blocks(path) if blocks and qc.quant.strategy == "tensor" else None
        return prepare(node, qc.quant, dtype, tensor_blocks, target)

    def walk(path: str, node: Any) -> Any:
        if isinstance(node, dict) and "weight_scale" in node and path.startswith("series."):
            # a layer-sharded series: each owned layer prepared, then stacked again (none owned: empty)
            n = node["weight_scale"].shape[0]
            layer = (
                (lambda i: {k: v[i] for k, v in node.items()})
                if n
                else lambda i: {k: v.new_zeros(v.shape[1:]) for k, v in node.items()}
            )
            layers = [one(path, layer(i)) for i in range(max(n, 1))]
            return pytree.tree_map(lambda *xs: torch.stack(xs)[:n], *layers)
        if isinstance(node, dict) and "weight_scale" in node:
            return one(path, node)
        if isinstance(node, torch.Tensor) and path.rsplit(".", 1)[-1] in linears and not path.startswith("series."):
            return prepare_dense(node, target)
        if isinstance(node, dict):
            return {k: walk(f"{path}.{k}" if path else k, v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(f"{path}.{i}", v) for i, v in enumerate(node)]
        return node

    if isinstance(params, Params):  # the tree walked, the config and the placement kept
        return params.replace(**{k: walk(k, v) for k, v in params.items()})
    return walk("", params)
