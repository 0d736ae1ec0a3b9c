"""The batch-invariant functions (:mod:`functional_npu.models.batch_invariant`) as torch ops, each with its gradient.

A compiler sees each reduction as one opaque node (``functional_npu::batch_linear``, ...) that runs the eager
kernels at their pinned shapes: a compiled rollout and a compiled training forward call the same kernels on the same
tiles as eager does, whatever else the compiler fuses around them. SiLU is not opaque: it is elementwise (the
polynomial ``exp``), and inductor fuses it with the gate's product, one rounding per op as eager
(:data:`~functional_npu.models.invariant.INDUCTOR_OPTIONS`). The gradients are the ordinary ones
(:mod:`functional_npu.models.invariant_ops`'s): training needs the forward's values to be the rollout's.

The module has the same functions as :mod:`functional_npu.models.invariant_ops` (the portable mode), so a model picks
its mode's module once (:func:`functional_npu.models.invariant_modes.ops`).
"""

from __future__ import annotations

import torch

from ..core.mesh import Mesh
from . import batch_invariant as math_
from . import invariant as portable
from . import invariant_ops
from .invariant_ops import _Attend, _Linear, _LogSoftmax, _RmsNorm, _Silu, sin_cos

__all__ = [
    "linear",
    "row_parallel",
    "rms_norm",
    "silu",
    "attend",
    "log_softmax",
    "sin_cos",
    "matmul",
    "experts",
    "decompositions",
]

_NS = "functional_npu"


@torch.library.custom_op(f"{_NS}::batch_linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, chunks: int, dtype: torch.dtype) -> torch.Tensor:
    return math_.linear(x, w, chunks, dtype)


@_linear_op.register_fake
def _(x, w, chunks, dtype):
    return x.new_empty(*x.shape[:-1], w.shape[0], dtype=dtype)


@torch.library.custom_op(f"{_NS}::batch_rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return math_.rms_norm(x, weight, eps, offset)


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return torch.empty_like(x, dtype=x.dtype if offset else torch.promote_types(weight.dtype, x.dtype))


@torch.library.custom_op(f"{_NS}::batch_log_softmax", mutates_args=())
def _log_softmax_op(x: torch.Tensor) -> torch.Tensor:
    return math_.log_softmax(x)


@_log_softmax_op.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.float32)


@torch.library.custom_op(f"{_NS}::batch_attend", mutates_args=())
def _attend_op(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, groups: int
) -> torch.Tensor:
    return math_.attend(q, keys, values, mask, scale, groups)


@_attend_op.register_fake
def _(q, keys, values, mask, scale, groups):
    return q.new_empty(*q.shape[:-1], values.shape[-1])


@torch.library.custom_op(f"{_NS}::batch_matmul", mutates_args=())
def _matmul_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _matmul_math(x, w)


@_matmul_op.register_fake
def _(x, w):
    return x.new_empty(w.shape[0], x.shape[1], w.shape[1])


class _BatchLinear(_Linear):
    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, chunks: int, dtype: torch.dtype) -> torch.Tensor:
        return _linear_op(x, w, chunks, dtype)


class _BatchRmsNorm(_RmsNorm):
    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        return _rms_norm_op(x, weight, eps, offset)


class _BatchLogSoftmax(_LogSoftmax):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _log_softmax_op(x)


class _BatchAttend(_Attend):
    @staticmethod
    def forward(q, keys, values, mask, scale: float, groups: int) -> torch.Tensor:
        return _attend_op(q, keys, values, mask, scale, groups)


class _PolySilu(_Silu):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return math_.silu(x)


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _matmul_op(x, w)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        return g @ w, g.transpose(1, 2) @ x


def linear(x: torch.Tensor, w: torch.Tensor, chunks: int = 1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`functional_npu.models.batch_invariant.linear` as one op (a column-parallel or whole linear: one
    matmul)."""
    return _BatchLinear.apply(x, w, chunks, dtype or x.dtype)


def row_parallel(x: torch.Tensor, w: torch.Tensor, mesh: Mesh, tp: str) -> torch.Tensor:
    """A row-parallel linear over ``tp``: this rank's share of the input dim's chunks
    (:func:`~functional_npu.models.invariant.row_chunks`), summed in float32, then the ranks' sums by
    :func:`~functional_npu.models.invariant.tp_sum`: the unsharded linear's bits at tp 1, 2, 4 or 8."""
    n = mesh.axis_size(tp)
    chunks = portable.row_chunks(x.shape[-1] * n, n, tp)
    return portable.tp_sum(linear(x, w, chunks, torch.float32), mesh, tp).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """:func:`functional_npu.models.batch_invariant.rms_norm` as one op."""
    return _BatchRmsNorm.apply(x, weight, float(eps), float(offset))


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU by the polynomial ``exp``, elementwise (compiled: fused), with SiLU's gradient."""
    return _PolySilu.apply(x)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """:func:`functional_npu.models.batch_invariant.log_softmax` as one op (float32)."""
    return _BatchLogSoftmax.apply(x)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """:func:`functional_npu.models.batch_invariant.attend` as one op."""
    return _BatchAttend.apply(q, keys, values, mask, q.shape[-1] ** -0.5 if scale is None else float(scale), groups)


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [S or 1, R, K]`` times each slot's ``w [S, N, K]`` transposed: ``[S, R, N]``, one batched matmul with the
    rows padded to a multiple of :data:`~functional_npu.models.batch_invariant.ROWS`."""
    return _Matmul.apply(x.expand(w.shape[0], *x.shape[1:]), w)


def experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The batch-invariant mode's routed experts before their sum over the k: ``weights[:, k] *
    expert[ids[:, k]](x)`` as ``[N, k, D]`` float32 (0 where ``ids`` is -1). Every local expert runs on every row
    (:func:`matmul`: one shape for any batch, a row's bits its own), then each (token, k) takes its expert's row."""
    n = x.shape[0]
    gate, up = matmul(x[None], gate_up).chunk(2, dim=-1)  # [S, N, F]
    y = matmul(silu(gate) * up, down)  # [S, N, D]
    chosen = y[ids.clamp(min=0), torch.arange(n, device=x.device)[:, None]]  # [N, k, D]
    return chosen.float() * torch.where(ids >= 0, weights.float(), 0.0)[..., None]


def decompositions() -> dict:
    """Each op as the aten ops of its function, for a compiler that converts aten ops one by one
    (:func:`functional_npu.models.invariant_ops.decompositions`' counterpart)."""
    ops = torch.ops.functional_npu
    return {
        ops.batch_linear.default: math_.linear,
        ops.batch_rms_norm.default: math_.rms_norm,
        ops.batch_log_softmax.default: math_.log_softmax,
        ops.batch_attend.default: math_.attend,
        ops.batch_matmul.default: _matmul_math,
    } | invariant_ops.decompositions()


def _matmul_math(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [S, R, K] @ w[S].T`` (``w [S, N, K]``) per slot, the rows padded to a multiple of ``ROWS``."""
    rows = x.shape[1]
    return torch.bmm(math_.pad_rows(x.transpose(0, 1)).transpose(0, 1), w.transpose(1, 2))[:, :rows]
