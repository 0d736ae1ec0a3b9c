"""Gradients of replicated parameters: the shares each holder computed, summed by the leaf's layout.

Differentiating a sharded forward (:mod:`functional_npu.core.collective_grads`) gives every rank its share of
the gradient of each element it holds. An element held by one rank has its whole gradient there; an element
several ranks hold (a leaf replicated over a mesh axis, a KV head replicated on ``tp // kv_heads`` ranks)
has its gradient split among its holders. :func:`sum_replicas` sums each element's shares over exactly the
ranks that hold it, so every holder ends with the same, whole gradient and the result has the params' own
layouts. Which ranks hold what is read from the layout alone (pure planning, :func:`replica_plan`), and
the sums are collectives over named axes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .collectives import all_gather, all_reduce
from .layout import Layout, Piece, Shard, dim_pieces, piece_len
from .mesh import Mesh

__all__ = ["ReplicaSum", "replica_plan", "sum_replicas"]


@dataclass(frozen=True)
class ReplicaSum:
    """How one leaf's gradient shares are summed.

    Attributes:
        axes: mesh axes the whole leaf is replicated over (one ``all_reduce`` over them, in mesh order).
        partial: per sharded dim whose pieces some coordinates share (replicated blocks), ``(dim, axes,
            copies)``: ``copies[c]`` lists, for coordinate ``c`` of ``axes``, the ``(local start, length,
            other coordinate, its local start)`` ranges it must add from the other holders.
    """

    axes: tuple[str, ...]
    partial: tuple[tuple[int, tuple[str, ...], tuple[tuple[tuple[int, int, int, int], ...], ...]], ...] = ()


def _local_offsets(pieces: Sequence[Piece]) -> list[tuple[Piece, int]]:
    out, at = [], 0
    for p in pieces:
        out.append((p, at))
        at += piece_len(p)
    return out


def _shared(spec: Shard, full_len: int, n: int) -> tuple[tuple[tuple[int, int, int, int], ...], ...] | None:
    """Per coordinate, the ranges of its pieces that other coordinates hold too (None: no coordinate shares)."""
    held = [_local_offsets(dim_pieces(spec, full_len, n, c)) for c in range(n)]
    copies, any_shared = [], False
    for c in range(n):
        mine = []
        for p, at in held[c]:
            for o in range(n):
                if o == c:
                    continue
                for q, at_o in held[o]:
                    lo, hi = max(p[0], q[0]), min(p[1], q[1])
                    if p[2] == q[2] == 1 and lo < hi:
                        mine.append((at + lo - p[0], hi - lo, o, at_o + lo - q[0]))
        any_shared |= bool(mine)
        copies.append(tuple(mine))
    return tuple(copies) if any_shared else None


def replica_plan(layout: Layout, full_shape: Sequence[int], mesh_shape: Mapping[str, int]) -> ReplicaSum:
    """The sums that make ``layout``'s gradient shares whole, on a mesh of ``mesh_shape`` (pure)."""
    used = set(layout.axes())
    whole = tuple(a for a in mesh_shape if a not in used and mesh_shape[a] > 1)
    partial = []
    for d, spec in enumerate(layout.dims):
        if not isinstance(spec, Shard):
            continue
        n = 1
        for a in spec.axes:
            n *= mesh_shape[a]
        copies = _shared(spec, full_shape[d], n) if n > 1 else None
        if copies is not None:
            partial.append((d, spec.axes, copies))
    return ReplicaSum(whole, tuple(partial))


def sum_replicas(grad: torch.Tensor, plan: ReplicaSum, mesh: Mesh) -> torch.Tensor:
    """``grad`` (this rank's shares) summed over the ranks that hold each of its elements (``plan`` from
    :func:`replica_plan`); a new tensor."""
    for d, axes, copies in plan.partial:
        # the group gathers in mesh order; coordinates along a layout's own axis order are found by rank
        in_order = tuple([a for a in mesh.axis_names if a in axes])
        every = all_gather(grad.unsqueeze(0), mesh, in_order, dim=0)  # [n, ...local]
        group = mesh.group_ranks(in_order)
        slot = [group.index(r) for r in mesh.group_ranks(axes)]
        ranges: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for start, length, other, other_start in copies[mesh.axis_index(axes)]:
            ranges.setdefault((start, length), []).append((other, other_start))
        parts, at = [], 0
        for (start, length), others in sorted(ranges.items()):
            if start > at:
                parts.append(grad.narrow(d, at, start - at))
            parts.append(sum((every[slot[o]].narrow(d, s, length) for o, s in others), grad.narrow(d, start, length)))
            at = start + length
        if at < grad.shape[d]:
            parts.append(grad.narrow(d, at, grad.shape[d] - at))
        grad = torch.cat(parts, dim=d)
    if plan.axes:
        grad = all_reduce(grad, mesh, plan.axes)
    return grad
