"""Bytes of the tensors a piece of code allocates and still holds, and their peak, measured as it runs: a figure that
takes nothing from the code it measures (on CPU, torch keeps no memory counter).

:class:`LiveBytes` is a ``TorchDispatchMode``: every op dispatched inside it whose output lives in a storage that is
not one of its inputs' (``empty``, ``stack``, ``clone``, a collective's output; not a view, not an in-place op) adds
that storage's bytes, and a finalizer on the storage takes them off the moment it is freed (torch keeps one Python
object per storage while the storage lives, so the finalizer runs when the last tensor or view of it goes). The
peak is kept over that sequence; :meth:`LiveBytes.peak_beside` gives the peak without the storages of some tensors
still held at the end (a transform's result), i.e. the extra memory it needed on the way. Meta tensors hold nothing.

Example:
    >>> with LiveBytes() as mem:                                  # doctest: +SKIP
    ...     out = reshard(local, src, dst, mesh, bucket_bytes=1 << 20)
    >>> mem.peak_beside(out.values())                             # doctest: +SKIP
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes"]


def _plain(x: object) -> bool:
    return isinstance(x, torch.Tensor) and type(x) is torch.Tensor and x.device.type != "meta"


class LiveBytes(TorchDispatchMode):
    """Storages allocated by ops inside it, while they live (see the module docstring).

    Attributes:
        live: bytes allocated inside and not yet freed.
        peak: the most ``live`` has been.
        allocations: how many storages were allocated inside.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.allocations = 0
        self._alive: dict[int, int] = {}  # data_ptr -> record id, for the storages allocated inside and alive
        self._events: list[tuple[int, int]] = []  # (record id, +bytes / -bytes) in the order they happened

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        inputs = {x.untyped_storage().data_ptr() for x in pytree.tree_leaves((args, kwargs)) if _plain(x)}
        for x in pytree.tree_leaves(out):
            if _plain(x):
                storage = x.untyped_storage()
                ptr, n = storage.data_ptr(), storage.nbytes()
                if n and ptr not in inputs and ptr not in self._alive:
                    self._add(storage, ptr, n)
        return out

    def _add(self, storage: torch.UntypedStorage, ptr: int, n: int) -> None:
        rid = len(self._events)
        self._alive[ptr] = rid
        self._events.append((rid, n))
        self.allocations += 1
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, ptr, rid, n)

    def _free(self, ptr: int, rid: int, n: int) -> None:
        if self._alive.get(ptr) == rid:
            del self._alive[ptr]
        self._events.append((rid, -n))
        self.live -= n

    def peak_beside(self, kept: Iterable[torch.Tensor]) -> int:
        """The peak of the bytes live inside, not counting the storages of ``kept`` (tensors alive now)."""
        ids = {self._alive.get(x.untyped_storage().data_ptr()) for x in kept if _plain(x)}
        live = peak = 0
        for rid, n in self._events:
            if rid not in ids:
                live += n
                peak = max(peak, live)
        return peak
