"""The invariant mode's functions, by ``Plan.invariant``: one module per mode with the same names (``linear``,
``row_parallel``, ``rms_norm``, ``silu``, ``attend``, ``log_softmax``, ``sin_cos``, ``experts``).

- ``"batch"``: :mod:`functional_npu.models.batch_invariant`, the fast kernels with their reduction orders pinned:
  a row's bits whatever the batch, position, cache length or chunking, on one device kind and kernel build;
- ``"portable"``: :mod:`functional_npu.models.invariant_ops`, trees of adds and polynomials: the same bits on any
  device that rounds IEEE adds.
"""

from __future__ import annotations

from types import ModuleType

from . import batch_invariant, invariant_ops

__all__ = ["ops"]


def ops(mode: str | bool) -> ModuleType:
    """The functions of invariant mode ``mode`` (``"batch"`` or ``"portable"``)."""
    if mode == "batch":
        return batch_invariant
    if mode == "portable":
        return invariant_ops
    raise ValueError(f"invariant mode must be 'batch' or 'portable', got {mode!r}")
