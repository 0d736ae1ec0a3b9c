"""The collectives' backward rules, written once: each collective's gradient is its transpose.

A sharded forward is differentiated as the sum of every rank's loss (:mod:`functional_npu.runtime.training.grad` seeds
each rank with ``1 / world`` of its loss, so the sum is the mean over the data-parallel groups). Under that
reading each collective is a linear map between the ranks' values, and its gradient is the transpose of that
map, which is again a collective:

========================  ==========================================================================
forward                   backward (of the output's gradient ``g``)
========================  ==========================================================================
all_reduce (sum / avg)    all_reduce (sum / avg): every rank's output read every rank's input
all_gather along ``d``    reduce_scatter (sum) along ``d``: the gradients of a rank's chunk, summed
reduce_scatter (sum)      all_gather: a rank's chunk came from every rank's input
all_to_all_single         all_to_all_single with the split sizes swapped: the chunks go back
broadcast from ``src``    all_reduce (sum), kept on ``src`` (zero elsewhere: their input was unread)
========================  ==========================================================================

The even ``all_to_all`` and ``permute`` are reshapes around ``all_to_all_single``; autograd differentiates
the reshapes. The gradient a rank holds for a value every rank of a group holds alike (the residual
stream after a row-parallel reduction) is its share; the shares sum to the gradient, and the next
transpose upstream sums them (an ``all_reduce`` where the forward reduced, a ``reduce_scatter`` where it
gathered). What is left, the shares of a replicated parameter, is summed by its layout
(:func:`functional_npu.core.replica_sum.sum_replicas`).

A ``max`` / ``min`` / ``product`` reduction has no gradient here (it only computes int8 scales); asking for
one raises. Each function is an :class:`torch.autograd.Function` over ``torch.distributed._functional_collectives``,
so ``torch.func`` and ``torch.compile(fullgraph=True)`` see the same ``_c10d_functional`` nodes forward and back.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.autograd import Function

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all_single", "broadcast", "LINEAR_OPS"]

LINEAR_OPS = ("sum", "avg")  # the reductions with a transpose


def _linear(op: str, what: str) -> str:
    if op not in LINEAR_OPS:
        raise RuntimeError(
            f"{what}(op={op!r}) has no gradient (only {' and '.join(LINEAR_OPS)} reductions do); it computes int8 "
            f"activation scales, so differentiate a model whose weights are not quantized"
        )
    return op


def _cotangent(g: torch.Tensor) -> torch.Tensor:
    """The gradient a backward rule sends: contiguous, and detached (the rule is linear, so nothing differentiates
    it again; funcol's own autograd kernels would otherwise record it under ``torch.func``)."""
    return g.detach().contiguous()


class _AllReduce(Function):
    @staticmethod
    def forward(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
        return funcol.all_reduce(x, op, group)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.op, ctx.group = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return funcol.all_reduce(_cotangent(g), _linear(ctx.op, "all_reduce"), ctx.group), None, None


class _AllGather(Function):
    @staticmethod
    def forward(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
        return funcol.all_gather_single(x, dim, group)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.dim, ctx.group = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return funcol.reduce_scatter_single(_cotangent(g), "sum", ctx.dim, ctx.group), None, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(x: torch.Tensor, op: str, dim: int, group: str, n: int) -> torch.Tensor:
        return funcol.reduce_scatter_single(x, op, dim, group)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.op, ctx.dim, ctx.group, ctx.n = inputs[1], inputs[2], inputs[3], inputs[4]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        y = funcol.all_gather_single(_cotangent(g), ctx.dim, ctx.group)
        return (y / ctx.n if _linear(ctx.op, "reduce_scatter") == "avg" else y), None, None, None, None


class _AllToAllSingle(Function):
    @staticmethod
    def forward(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: str) -> torch.Tensor:
        return funcol.all_to_all_single(x, out_splits, in_splits, group)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.out_splits, ctx.in_splits, ctx.group = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return funcol.all_to_all_single(_cotangent(g), ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


class _Broadcast(Function):
    @staticmethod
    def forward(x: torch.Tensor, src: int, group: str, is_src: bool) -> torch.Tensor:
        return funcol.broadcast(x, src, group)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.group, ctx.is_src = inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        total = funcol.all_reduce(_cotangent(g), "sum", ctx.group)
        return (total if ctx.is_src else torch.zeros_like(total)), None, None, None


def all_reduce(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return _AllReduce.apply(x, op, group)


def all_gather(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return _AllGather.apply(x, dim, group)


def reduce_scatter(x: torch.Tensor, op: str, dim: int, group: str, n: int) -> torch.Tensor:
    return _ReduceScatter.apply(x, op, dim, group, n)


def all_to_all_single(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: str):
    return _AllToAllSingle.apply(x, out_splits, in_splits, group)


def broadcast(x: torch.Tensor, src: int, group: str, is_src: bool) -> torch.Tensor:
    return _Broadcast.apply(x, src, group, is_src)
