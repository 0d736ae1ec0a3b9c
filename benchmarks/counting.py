"""Bytes a rank receives from the other ranks, counted at the collectives as they are dispatched, and the least
it could receive, worked out from element indices: two figures that take nothing from the planner they check
(``functional_npu/core/reshard.py``).

:class:`ReceivedBytes` is a ``TorchDispatchMode``: every collective dispatched inside it, whether a functional
collective (``_c10d_functional.*``: this library's exchanges, DTensor's redistributions) or a process group's own
op (``c10d.*``: ``torch.distributed.all_to_all_single`` and the rest, DTensor's ``distribute_tensor``), adds the
bytes this rank receives from the *other* ranks of its group, read off the op's own arguments (its tensors,
split sizes, source rank and group). A collective it has no rule for raises, so nothing is left out silently.
What a rank sends itself (its own chunk of an all-to-all or a gather) is not counted.

:func:`need_of_layouts` and :func:`need_of_ids` give the lower bound: the bytes a rank needs after a move and does
not hold before it. Each element of a tensor is named by its index (``torch.arange``), the tensor is cut by the
source and by the destination layout with :func:`functional_npu.core.shard.shard` (what a layout means, the
definition the other tests check against DTensor and the loaders), or the held and needed index tensors come from
elsewhere (FSDP2's own shards, the checkpoint loader's slices), and the missing indices are counted.

Example:
    >>> with ReceivedBytes() as counted:                      # doctest: +SKIP
    ...     out = reshard(local, src, dst, mesh)
    >>> counted.received == need_of_layouts(shapes, src, dst, mesh, mesh.rank).missing   # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from functional_npu.core import Layout, Mesh, shard

__all__ = ["ReceivedBytes", "Need", "need_of_ids", "need_of_layouts"]

_NAMESPACES = ("_c10d_functional", "c10d", "_dtensor", "functional_npu")
_NO_DATA = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_", "check_for_nan")


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _group(group: Any) -> tuple[int, int]:
    """(this rank's index in ``group``, its size): a functional collective names its group, a c10d op holds it."""
    if isinstance(group, str):
        group = dist.distributed_c10d._resolve_process_group(group)
    elif isinstance(group, torch.ScriptObject):  # a c10d op's argument: the process group, boxed
        group = dist.ProcessGroup.unbox(group)
    return group.rank(), group.size()


def _split(total_rows: int, splits: Sequence[int], n: int) -> list[int]:
    """Rows per peer of an all-to-all: the split sizes given, else ``total_rows`` cut evenly."""
    return list(splits) if len(splits) else [total_rows // n] * n


def _all_to_all(out_rows: int, row_bytes: int, splits: Sequence[int], group: Any) -> int:
    me, n = _group(group)
    rows = _split(out_rows, splits, n)
    return (sum(rows) - rows[me]) * row_bytes


def _row_bytes(x: torch.Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


def _from_root(nbytes: int, root: int, group: Any) -> int:
    return 0 if _group(group)[0] == root else nbytes


def _others(per_rank: Sequence[torch.Tensor], group: Any) -> int:
    me = _group(group)[0]
    return sum(_nbytes(x) for j, x in enumerate(per_rank) if j != me)


def _times_others(nbytes: int, group: Any) -> int:
    return nbytes * (_group(group)[1] - 1)


def _all_reduce(nbytes: int, group: Any) -> int:
    n = _group(group)[1]
    return 2 * (n - 1) * nbytes // n


# op name -> bytes this rank receives from the others, from the op's arguments (its schema's order)
_RULES = {
    # functional collectives (torch.distributed._functional_collectives, traced as they are)
    "_c10d_functional.all_to_all_single": lambda x, out, inp, g: _all_to_all(x.shape[0], _row_bytes(x), out, g),
    "_c10d_functional.all_gather_into_tensor": lambda x, n, g: _times_others(_nbytes(x), g),
    "_c10d_functional.all_gather_into_tensor_out": lambda x, n, g, out=None: _times_others(_nbytes(x), g),
    "_c10d_functional.all_gather_into_tensor_coalesced": lambda xs, n, g: _times_others(sum(map(_nbytes, xs)), g),
    "_c10d_functional.reduce_scatter_tensor": lambda x, op, n, g: _times_others(_nbytes(x) // n, g),
    "_c10d_functional.reduce_scatter_tensor_out": lambda x, op, n, g, out=None: _times_others(_nbytes(x) // n, g),
    "_c10d_functional.reduce_scatter_tensor_coalesced": lambda xs, op, n, g: _times_others(
        sum(map(_nbytes, xs)) // n, g
    ),
    "_c10d_functional.all_reduce": lambda x, op, g: _all_reduce(_nbytes(x), g),
    "_c10d_functional.all_reduce_": lambda x, op, g: _all_reduce(_nbytes(x), g),
    "_c10d_functional.all_reduce_coalesced": lambda xs, op, g: _all_reduce(sum(map(_nbytes, xs)), g),
    "_c10d_functional.all_reduce_coalesced_": lambda xs, op, g: _all_reduce(sum(map(_nbytes, xs)), g),
    "_c10d_functional.broadcast": lambda x, src, g: _from_root(_nbytes(x), src, g),
    "_c10d_functional.broadcast_": lambda x, src, g: _from_root(_nbytes(x), src, g),
    "_dtensor.shard_dim_alltoall": lambda x, gather, shard_, g: _times_others(_nbytes(x) // _group(g)[1], g),
    # this library's in-place broadcast into a prefetch slot (its broadcast runs inside the op)
    "functional_npu.broadcast_into": lambda slot, parts, after, src, g, n: (
        0 if n == 1 else _from_root(_nbytes(slot), src, g)
    ),
    # a process group's own ops (torch.distributed.*, DTensor's distribute_tensor)
    "c10d.alltoall_base_": lambda out, x, g, out_splits, in_splits, *_: _all_to_all(
        out.shape[0], _row_bytes(out), out_splits, g
    ),
    "c10d.alltoall_": lambda outs, xs, g, *_: _others(outs, g),
    "c10d._allgather_base_": lambda out, x, g, *_: _times_others(_nbytes(x), g),
    "c10d.allgather_": lambda outs, xs, g, *_: sum(_others(per_rank, g) for per_rank in outs),
    "c10d.allgather_into_tensor_coalesced_": lambda outs, xs, g, *_: _times_others(sum(map(_nbytes, xs)), g),
    "c10d._reduce_scatter_base_": lambda out, x, g, *_: _times_others(_nbytes(out), g),
    "c10d.reduce_scatter_": lambda outs, xs, g, *_: _times_others(sum(map(_nbytes, outs)), g),
    "c10d.allreduce_": lambda xs, g, *_: _all_reduce(sum(map(_nbytes, xs)), g),
    "c10d.allreduce_coalesced_": lambda xs, g, *_: _all_reduce(sum(map(_nbytes, xs)), g),
    "c10d.broadcast_": lambda xs, g, root, *_: _from_root(sum(map(_nbytes, xs)), root, g),
    "c10d.scatter_": lambda outs, xs, g, root, *_: _from_root(sum(map(_nbytes, outs)), root, g),
    "c10d.gather_": lambda outs, xs, g, root, *_: sum(_others(per_rank, g) for per_rank in outs),
    "c10d.recv_": lambda xs, g, src, tag: sum(map(_nbytes, xs)),
    "c10d.send": lambda xs, g, dst, tag: 0,
}


class ReceivedBytes(TorchDispatchMode):
    """Counts, on this rank, the collectives dispatched inside it and the bytes each brings from the other ranks.

    Per collective (``n`` ranks in its group, this rank at index ``me``):

    * all-to-all (``all_to_all_single``, ``alltoall_base_``, ``alltoall_``): the rows of the output that come from
      the others, ``sum(output_split_sizes) - output_split_sizes[me]`` (even splits when none are given);
    * all-gather: ``n - 1`` times this rank's input (every other rank's chunk);
    * reduce-scatter: ``n - 1`` chunks, the others' contributions to this rank's chunk;
    * broadcast, scatter: the buffer, unless this rank is the root (then nothing); gather: the others' inputs on
      the root; ``recv``: the buffer;
    * all-reduce: ``2 (n - 1) / n`` of the buffer, a convention: what each rank receives in the bandwidth-optimal
      ring (a reduce-scatter then an all-gather); the bytes a backend really moves depend on its algorithm.

    Attributes:
        received: bytes received from the other ranks, over every collective so far.
        calls: collectives per op name (``"_c10d_functional.all_to_all_single"``: 1, ...).
        by_op: bytes received per op name.
    """

    def __init__(self) -> None:
        super().__init__()
        self.received = 0
        self.calls: Counter[str] = Counter()
        self.by_op: Counter[str] = Counter()

    @property
    def collectives(self) -> int:
        """How many collectives ran inside (waits and barriers not counted)."""
        return sum(self.calls.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        name = f"{func.namespace}.{func.overloadpacket.__name__}"
        if func.namespace in _NAMESPACES and func.overloadpacket.__name__ not in _NO_DATA:
            if name in _RULES:
                got = _RULES[name](*args, **kwargs)
                self.received += got
                self.by_op[name] += got
                self.calls[name] += 1
            elif func.namespace != "functional_npu":  # this library's other ops move nothing between ranks
                raise NotImplementedError(f"ReceivedBytes: no rule for {func}; add one to benchmarks/counting.py")
        return func(*args, **kwargs)


@dataclass(frozen=True, slots=True)
class Need:
    """Bytes one rank needs after a move: ``missing`` it does not hold before (the least it must receive),
    ``held`` it does."""

    missing: int
    held: int

    def __add__(self, other: Need) -> Need:
        return Need(self.missing + other.missing, self.held + other.held)


def need_of_ids(held: Iterable[torch.Tensor], needed: Iterable[torch.Tensor], itemsize: int) -> Need:
    """:class:`Need` from element ids: ``held`` are the ids this rank holds, ``needed`` those it needs (any shapes;
    ids unique per element, each id counted once), every element ``itemsize`` bytes."""
    have = torch.cat([x.reshape(-1).long() for x in held] or [torch.empty(0, dtype=torch.long)]).unique()
    want = torch.cat([x.reshape(-1).long() for x in needed] or [torch.empty(0, dtype=torch.long)]).unique()
    inside = int(torch.isin(want, have).sum())
    return Need((want.numel() - inside) * itemsize, inside * itemsize)


def need_of_layouts(
    shapes: Mapping[str, tuple[Sequence[int], torch.dtype]],
    src: Mapping[str, Layout],
    dst: Mapping[str, Layout],
    mesh: Mesh,
    rank: int,
) -> Need:
    """:class:`Need` of world rank ``rank`` moving every tensor ``{path: (full shape, dtype)}`` from its ``src`` to
    its ``dst`` layout on ``mesh``: each tensor's element indices cut by both layouts at ``rank``'s coordinate."""
    total = Need(0, 0)
    for path, (shape, dtype) in shapes.items():
        ids = torch.arange(math.prod(shape)).reshape(tuple(shape))
        held = shard({path: ids}, {path: src[path]}, mesh, coordinate=rank)[path]
        needed = shard({path: ids}, {path: dst[path]}, mesh, coordinate=rank)[path]
        total += need_of_ids([held], [needed], torch.empty((), dtype=dtype).element_size())
    return total
