"""What arrives in a prefetch ring's slots, counted where the model reads it, against a reference made without a ring.

A ring write that silently does nothing leaves the slot's old contents, and a slot whose old contents happen to be
the right layer (a ring of ``k + 1 = L`` slots holds each layer in the same slot every step) reads correctly anyway:
tokens alone cannot show the write failed. :class:`Deliveries` watches every ``functional_npu::broadcast_into`` (the
one op every ring write is, from a peer or from host memory), fills the slot with a poison pattern just before the
write runs, and at the first ``wait_tensor`` of the slot after it (where the model may read it) compares the slot
with each layer's reference bytes: the bytes delivered are the slot's when it holds one layer's bytes exactly, else
none, and the write is reported (poison still there: nothing arrived). It runs eagerly and under ``torch.compile``
(it ignores compile internals, so dynamo compiles under it and it sees the compiled graph's extern calls).

:class:`DropWrite` is the planted failure: it swallows one ring write, as a copy that fails silently would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

POISON = 0xA5
_WRITE = "functional_npu.broadcast_into"
_WAIT = "_c10d_functional.wait_tensor"


def _key(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size()


class _RingMode(TorchDispatchMode):
    """A mode that sees the ring's writes whether they run as the op itself (eager, inductor's extern calls) or inside
    ``auto_functionalized_v2`` (an AOT-functionalized graph that is not reinplaced, aot_eager's: the op writes a clone
    of the slot, which the graph waits on and copies back into the slot at its end): that higher-order op is run by
    its own dense rule with this mode on, so the op inside it is seen; other higher-order ops run as they are."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def _higher_order(self, func, args, kwargs):
        if func is torch.ops.higher_order.auto_functionalized_v2:
            from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2_dense

            with self:
                return auto_functionalized_v2_dense(*args, **kwargs)
        return func(*args, **kwargs)


class Deliveries(_RingMode):
    """Count the bytes each ring write delivers (see the module docstring).

    ``reference``: each layer's bytes of each ring group, ``reference[layer][group]`` (a flat tensor of the group's
    dtype: the layer's leaves of that group, flattened, in the group's order), made from params loaded without a
    ring. Afterwards: ``writes`` (ring writes issued), ``checked`` (those waited on), ``delivered`` (bytes that
    arrived equal to a layer's), ``layers`` (the layer each checked write held, in order) and ``failures`` (one line
    per write that did not deliver a layer)."""

    def __init__(self, reference: Sequence[Sequence[torch.Tensor]]):
        super().__init__()
        self.reference = [[r.reshape(-1).view(torch.uint8) for r in layer] for layer in reference]
        self.writes = 0
        self.checked = 0
        self.delivered = 0
        self.layers: list[int] = []
        self.failures: list[str] = []
        self._pending: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        self._held: list[torch.UntypedStorage] = []  # no slot address is freed and reused while it records

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        name = str(func.overloadpacket)
        if name == _WRITE:
            slot = args[0]
            slot.view(torch.uint8).fill_(POISON)
            self.writes += 1
            self._held.append(slot.untyped_storage())
            self._pending[_key(slot)] = (self.writes, slot)
        out = func(*args, **kwargs)
        if name == _WAIT and _key(args[0]) in self._pending:
            self._check(*self._pending.pop(_key(args[0])))
        return out

    def summary(self) -> dict:
        """The counts as a dict (what a rank returns): writes, checked, delivered, layers, failures."""
        return {"writes": self.writes, "checked": self.checked, "delivered": self.delivered, "layers": self.layers,
                "failures": self.failures}  # fmt: skip

    def _check(self, write: int, slot: torch.Tensor) -> None:
        self.checked += 1
        got = slot.reshape(-1).view(torch.uint8)
        for layer, groups in enumerate(self.reference):
            if any(r.numel() == got.numel() and torch.equal(r, got) for r in groups):
                self.delivered += got.numel()
                self.layers.append(layer)
                return
        if got.numel() and bool((got == POISON).all()):
            self.failures.append(f"ring write {write}: nothing arrived in its slot of {got.numel()} bytes")
        else:
            self.failures.append(f"ring write {write}: its slot of {got.numel()} bytes holds no layer's bytes")


class DropWrite(_RingMode):
    """Swallow ring write number ``n`` (1-based, in issue order): the planted copy that does nothing."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.seen = n, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._higher_order(func, args, kwargs or {})
        if str(func.overloadpacket) == _WRITE:
            self.seen += 1
            if self.seen == self.n:
                return None
        return func(*args, **(kwargs or {}))


def assert_every_write_delivered(seen: dict, groups: int, layers: int, per_forward: int, forwards: int) -> None:
    """What :meth:`Deliveries.summary` counted, for a ring of ``groups`` groups over ``layers`` layers run for
    ``forwards`` forwards: every write was waited on holding its layer's bytes, layer after layer in order (``0 ..
    L - 1`` each forward, one write per group), every forward's layers in full (``per_forward`` bytes: the L
    layers' ringed leaves), plus the next step's first layers when the run ended by waiting on them."""
    g, L = groups, layers
    assert seen["failures"] == [], seen["failures"][:3]
    assert seen["writes"] == seen["checked"] >= forwards * L * g, (seen["writes"], seen["checked"])
    assert seen["checked"] % g == 0, seen["checked"]  # every layer's groups, whole
    assert seen["layers"] == [j // g % L for j in range(seen["checked"])]
    steps, rest = divmod(seen["checked"], L * g)
    assert seen["delivered"] == steps * per_forward + rest // g * (per_forward // L), seen["delivered"]


def ring_reference(layers: Sequence[Mapping[str, torch.Tensor]], groups: Sequence[Sequence[str]]) -> list:
    """``reference[layer][group]`` for :class:`Deliveries`: each layer's leaves (``layers[i]``: dotted path ->
    tensor, from params loaded without a ring) of each group, flattened and concatenated in the group's order."""
    return [[torch.cat([layer[leaf].reshape(-1) for leaf in group]) for group in groups] for layer in layers]
