"""Stream hints for graph compilers that place ops on streams themselves.

The prefetch ring's order is in the graph's data edges (each write into a slot takes the tensor it
must wait for, :func:`functional_npu.core.collectives.broadcast_into`) for every compiler that orders
by them (inductor; GE, where torchair's converter makes ``after`` a control edge). A captured graph
orders its streams by events only, and npugraph_ex's reinplacing rewrites the residual stream in place
(so ``after`` names a buffer written again later): there the events below carry the order. Where a
compiler runs ops on several streams (torchair's GE, a captured graph), the broadcasts say where they
run with these hints, as torchair's multi-stream scopes do:

- ``side(tag)``: a context in which the enclosed ops run on a secondary stream named ``tag``;
- ``after(t, dep)``: ``t``, with every consumer made to wait for ``dep`` (a control edge);
- ``signal(name)`` / ``wait(name)``: the current stream marks the work it has issued so far (an event
  record), and the current stream waits for the last mark of that name (an event wait). A captured
  graph (ACL graph) orders streams only by events: data edges between streams order nothing there.

:data:`INLINE` (every backend but torchair) adds nothing to the graph. The torchair backend supplies
``torchair.scope.npu_stream_switch`` and ``torchair.scope.npu_wait_tensor``; the npugraph_ex backend
its ``_user_stream_label`` scope and tagged events (see :mod:`functional_npu.runtime.serving.backends`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Streams", "INLINE", "COPY_BACK", "UNORDERED", "PREFETCH_STREAM"]

PREFETCH_STREAM = "prefetch"  # the stream tag the layer-shard broadcasts run on


def _no_scope(tag: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def _no_edge(t: torch.Tensor, dep: torch.Tensor) -> torch.Tensor:
    return t


def _no_event(name: str) -> None:
    return None


@dataclass(frozen=True)
class Streams:
    """The ordering hints (see the module docstring); ``name`` says whose they are."""

    name: str
    side: Callable[[str], contextlib.AbstractContextManager[Any]]
    after: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    gate: bool = True  # a prefetch write into a ring slot waits for the previous layer's reads (False: the control)
    # the next step's first k layers leave the graph in flight; False where the compiler copies mutated inputs
    # back instead of writing them in place (aot_eager): the copy would read a layer still arriving, so they
    # are waited at the end of the step
    hand_over: bool = True
    signal: Callable[[str], None] = _no_event
    wait: Callable[[str], None] = _no_event
    # the registered name of a one-rank process group that delivers each copy from host memory (an emulated host
    # link, :mod:`functional_npu.parallel.host_link`); "": copies land when made
    host_link: str = ""


INLINE = Streams("inline", _no_scope, _no_edge)
COPY_BACK = Streams("copy-back", _no_scope, _no_edge, hand_over=False)
# the control that shows the hazard check can fail: ring writes not ordered after the reads of the slot's last layer
UNORDERED = Streams("unordered", _no_scope, _no_edge, gate=False)
