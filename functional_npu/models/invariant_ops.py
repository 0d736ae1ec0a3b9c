"""The invariant functions (:mod:`functional_npu.models.invariant`) as torch ops, each with its gradient.

A compiler sees each as one opaque node (``functional_npu::invariant_linear``, ...), as it sees a hand-written
kernel, and calls the same aten sequence that eager runs: the compiled forward's bits are eager's by construction,
and a graph of them compiles in the time of an ordinary model's (traced op by op, inductor generated C++ for every
level of every tree: about 35 s a layer on two cores, most of it in its code generation). The gradients are the
ordinary ones (matmuls, softmax's and RMSNorm's closed forms in float32): training needs the forward's values to be
the rollout's, not its backward's order.

:func:`row_parallel` adds the tensor-parallel sum (:func:`~functional_npu.models.invariant.tp_sum`, a collective the
compiler sees) to the op's linear.
"""

from __future__ import annotations

import torch

from ..core.mesh import Mesh
from . import invariant as math_

__all__ = [
    "experts",
    "linear",
    "row_parallel",
    "rms_norm",
    "silu",
    "attend",
    "log_softmax",
    "sin_cos",
    "decompositions",
    "SiluFunction",
    "RmsNormFunction",
    "LogSoftmaxFunction",
    "AttendFunction",
]

_NS = "functional_npu"


# the forwards: one opaque op each (no autograd of their own: the Functions below give the gradients, in the form
# torch.func and dynamo take)


@torch.library.custom_op(f"{_NS}::invariant_linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, chunks: int, dtype: torch.dtype) -> torch.Tensor:
    return math_.linear(x, w, chunks, dtype)


@_linear_op.register_fake
def _(x, w, chunks, dtype):
    return x.new_empty(*x.shape[:-1], w.shape[0], dtype=dtype)


@torch.library.custom_op(f"{_NS}::invariant_rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return math_.rms_norm(x, weight, eps, offset)


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return torch.empty_like(x, dtype=x.dtype if offset else torch.promote_types(weight.dtype, x.dtype))


@torch.library.custom_op(f"{_NS}::invariant_silu", mutates_args=())
def _silu_op(x: torch.Tensor) -> torch.Tensor:
    return math_.silu(x)


@_silu_op.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op(f"{_NS}::invariant_log_softmax", mutates_args=())
def _log_softmax_op(x: torch.Tensor) -> torch.Tensor:
    return math_.log_softmax(x)


@_log_softmax_op.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.float32)


@torch.library.custom_op(f"{_NS}::invariant_attend", mutates_args=())
def _attend_op(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, groups: int
) -> torch.Tensor:
    return math_.attend(q, keys, values, mask, scale, groups)


@_attend_op.register_fake
def _(q, keys, values, mask, scale, groups):
    return q.new_empty(*q.shape[:-1], values.shape[-1])


@torch.library.custom_op(f"{_NS}::invariant_sin_cos", mutates_args=())
def _sin_cos_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return math_.sin_cos(x)


@_sin_cos_op.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.float32), torch.empty_like(x, dtype=torch.float32)


# the gradients: the ordinary ones, in float32 (public: the batch-invariant mode's functions take them, with its own
# forwards)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, chunks: int, dtype: torch.dtype) -> torch.Tensor:
        return _linear_op(x, w, chunks, dtype)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0], inputs[1])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        gf = g.float().reshape(-1, w.shape[0])
        gx = (gf @ w.float()).to(x.dtype).reshape(x.shape)
        gw = (gf.T @ x.float().reshape(-1, x.shape[-1])).to(w.dtype)
        return gx, gw, None, None


class RmsNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        return _rms_norm_op(x, weight, eps, offset)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.eps, ctx.offset = inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        xf, gf = x.float(), g.float()
        r = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + ctx.eps)
        gs = gf * (weight.float() + ctx.offset)  # the gradient at x * r
        gx = r * gs - xf * r.pow(3) * (gs * xf).mean(-1, keepdim=True)
        gw = (gf * xf * r).reshape(-1, x.shape[-1]).sum(0)
        return gx.to(x.dtype), gw.to(weight.dtype), None, None


class SiluFunction(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _silu_op(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (x,) = ctx.saved_tensors
        xf = x.float()
        s = torch.sigmoid(xf)
        return (g.float() * s * (1 + xf * (1 - s))).to(x.dtype)


class LogSoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _log_softmax_op(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(output)
        ctx.dtype = inputs[0].dtype

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (y,) = ctx.saved_tensors
        return (g - torch.exp(y) * g.sum(-1, keepdim=True)).to(ctx.dtype)


class AttendFunction(torch.autograd.Function):
    @staticmethod
    def forward(q, keys, values, mask, scale: float, groups: int) -> torch.Tensor:
        return _attend_op(q, keys, values, mask, scale, groups)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        q, keys, values, mask, scale, groups = inputs
        ctx.save_for_backward(q, keys, values, mask)
        ctx.scale, ctx.groups = scale, groups

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        """The probabilities recomputed with torch's softmax, then attention's usual gradient."""
        q, keys, values, mask = ctx.saved_tensors
        b, h, s, d = q.shape
        kv, c = keys.shape[1], keys.shape[2]
        qf = q.float().reshape(b, kv, ctx.groups, s, d)
        kf, vf = keys.float()[:, :, None], values.float()[:, :, None]  # [B, kv, 1, C, .]
        scores = (qf @ kf.transpose(-1, -2)) * ctx.scale
        p = torch.softmax(scores.masked_fill(~mask.reshape(b, 1, 1, s, c), float("-inf")), -1)  # [B, kv, g, S, C]
        go = g.float().reshape(b, kv, ctx.groups, s, -1)
        dv = (p.transpose(-1, -2) @ go).sum(2)
        dp = go @ vf.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * ctx.scale
        dq = (ds @ kf).reshape(b, h, s, d)
        dk = (ds.transpose(-1, -2) @ qf).sum(2)
        return dq.to(q.dtype), dk.to(keys.dtype), dv.to(values.dtype), None, None, None


def linear(x: torch.Tensor, w: torch.Tensor, chunks: int | None = None, dtype: torch.dtype | None = None):
    """:func:`functional_npu.models.invariant.linear` as one op."""
    return _Linear.apply(x, w, math_.split_of(x.shape[-1]) if chunks is None else chunks, dtype or x.dtype)


def row_parallel(x: torch.Tensor, w: torch.Tensor, mesh: Mesh, tp: str) -> torch.Tensor:
    """:func:`functional_npu.models.invariant.row_parallel` with its linear as one op."""
    n = mesh.axis_size(tp)
    chunks = math_.row_chunks(x.shape[-1] * n, n, tp)
    return math_.tp_sum(linear(x, w, chunks, torch.float32), mesh, tp).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """:func:`functional_npu.models.invariant.rms_norm` as one op."""
    return RmsNormFunction.apply(x, weight, float(eps), float(offset))


def silu(x: torch.Tensor) -> torch.Tensor:
    """:func:`functional_npu.models.invariant.silu` as one op."""
    return SiluFunction.apply(x)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """:func:`functional_npu.models.invariant.log_softmax` as one op (float32)."""
    return LogSoftmaxFunction.apply(x)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """:func:`functional_npu.models.invariant.attend` as one op."""
    return AttendFunction.apply(q, keys, values, mask, q.shape[-1] ** -0.5 if scale is None else float(scale), groups)


def sin_cos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`functional_npu.models.invariant.sin_cos` as one op (rotary angles: no gradient)."""
    return _sin_cos_op(x)


def decompositions() -> dict:
    """Each op as the aten ops of its function (:mod:`functional_npu.models.invariant`), for a compiler that converts
    aten ops one by one and has nothing for an opaque op: torchair's and npugraph_ex's ``custom_decompositions``
    (their GE and ACL graphs then hold the trees of adds and multiplies themselves)."""
    ops = torch.ops.functional_npu
    return {
        ops.invariant_linear.default: math_.linear,
        ops.invariant_rms_norm.default: math_.rms_norm,
        ops.invariant_silu.default: math_.silu,
        ops.invariant_log_softmax.default: math_.log_softmax,
        ops.invariant_attend.default: math_.attend,
        ops.invariant_sin_cos.default: math_.sin_cos,
    }


_EXPERT_BUDGET = 1 << 24  # elements of one invariant product [rows, k, out, in] held at once (64 MiB of float32)


def experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The portable mode's :func:`~functional_npu.models.experts.local_experts`, before its sum over the k:
    ``weights[:, k] * expert[ids[:, k]](x)`` as ``[N, k, D]`` float32 (0 where ``ids`` is -1). Each token and chosen
    expert its own products with the expert's weight rows, summed by
    :func:`~functional_npu.models.invariant.tree_sum` over the input dim, rounded to ``x``'s dtype as a linear's
    output is: the same bits whatever the rows beside it, in chunks of rows whose product ``[rows, k, 2F, D]`` holds
    at most 2 ** 24 elements."""
    n, k = ids.shape
    chosen = ids.clamp(min=0)  # a -1 reads slot 0 and is weighted 0
    w = torch.where(ids >= 0, weights.float(), 0.0)[..., None]  # [N, k, 1]
    step = max(1, _EXPERT_BUDGET // max(1, k * gate_up[0].numel(), k * down[0].numel()))
    parts = []
    for i in range(0, n, step):
        rows, c = x[i : i + step], chosen[i : i + step]
        gu = math_.tree_sum(rows[:, None, None, :].float() * gate_up[c].float()).to(x.dtype)  # [r, k, 2F]
        gate, up = gu.chunk(2, dim=-1)
        h = silu(gate) * up
        y = math_.tree_sum(h[:, :, None, :].float() * down[c].float()).to(x.dtype)  # [r, k, D]
        parts.append(y.float() * w[i : i + step])
    return parts[0] if len(parts) == 1 else torch.cat(parts)
