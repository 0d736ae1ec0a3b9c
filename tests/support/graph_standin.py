"""A stand-in for a device's graph module (``torch.cuda``'s ``CUDAGraph``, ``graph`` and ``graph_pool_handle``) that
runs on the CPU with a device graph's semantics, so that :mod:`functional_npu.runtime.serving.step_graph` runs in CI
up to the device.

A capture records every op dispatched inside it, with the tensors it read and wrote; a replay runs those ops again
on the same tensors and writes each result into the tensor the capture produced, running no Python of the caller: as
a device graph replays its kernels on fixed addresses. What a device graph does and this one copies:

- tensors made during the capture belong to the graph: when the capture ends they are poisoned (every byte 0xFF, NaN
  in a float), since a capture runs nothing and its outputs hold nothing until a replay;
- an input that is not one of the captured tensors is not read by a replay (a new tensor passed on a later call);
- Python state the captured call changed (a counter, a ring's phase) is not changed by a replay;
- an op that waits for the device on the host (``.item()``, ``nonzero``) inside a capture raises, as CUDA's stream
  capture refuses it.

The capture itself runs the ops too (to give Python the shapes and values it branches on), then undoes what they wrote
into tensors that existed before it (a KV cache, a ring slot): after a capture they hold what they held before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# ops that copy a device value to the host, refused inside a capture
SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.item.default}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t``, as bytes."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes in place (its schema's mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        out += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.made: dict[int, torch.Tensor] = {}  # storages first seen as an op's output, one tensor over each
        self.read: set[int] = set()  # storages read before any op of the capture made them
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a written storage's bytes before the capture

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCS:
            raise RuntimeError(f"stand-in capture: {func} waits for the device on the host inside a capture")
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and _storage(t) not in self.made:
                self.read.add(_storage(t))
        for t in _written(func, args, kwargs):
            if _storage(t) not in self.made and _storage(t) not in self.saved:
                whole = _bytes(t)
                self.saved[_storage(t)] = (whole, whole.clone())
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and _storage(t) not in self.read:
                self.made.setdefault(_storage(t), t)
        self.ops.append((func, args, kwargs, out))
        return out


class Graph:
    """One captured graph: its ops, replayed on the captured tensors."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.replays = 0

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            got = func(*args, **kwargs)
            for mine, new in zip(pytree.tree_leaves(out), pytree.tree_leaves(got)):
                if isinstance(mine, torch.Tensor) and mine.data_ptr() != new.data_ptr():
                    mine.copy_(new)
        self.replays += 1


class StandInGraphs:
    """The device module's graph API (``api``): ``CUDAGraph()``, ``graph(g, pool=...)``, ``graph_pool_handle()``.
    ``captured`` lists the graphs made, in order."""

    def __init__(self) -> None:
        self.captured: list[Graph] = []

    def CUDAGraph(self) -> Graph:  # noqa: N802 (the device module's name)
        return Graph()

    def graph_pool_handle(self) -> object:
        return object()

    @contextlib.contextmanager
    def graph(self, g: Graph, pool: Any = None) -> Iterator[Graph]:
        recorder = _Recorder()
        with recorder:
            yield g
        g.ops = recorder.ops
        for t in recorder.made.values():  # what the capture made holds nothing until the graph is replayed
            _bytes(t).fill_(0xFF)
        for whole, before in recorder.saved.values():  # nor did it write anything that was there before it
            whole.copy_(before)
        self.captured.append(g)

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.captured)
