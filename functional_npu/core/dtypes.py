"""The dtype a caller asks weights in: a floating-point ``torch.dtype``, checked once with a clear error."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["float_dtype"]


def float_dtype(dtype: Any, where: str) -> torch.dtype:
    """``dtype`` if it is a floating-point ``torch.dtype`` (``torch.bfloat16``, ...).

    Raises:
        TypeError for anything else (a string, an integer or bool type, a Python type), naming ``where``
        and the fix.
    """
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str):
        fix = f"torch.{dtype}" if isinstance(getattr(torch, dtype, None), torch.dtype) else "torch.bfloat16"
        raise TypeError(f"{where}: dtype must be a torch.dtype, got the string {dtype!r}; pass {fix}")
    raise TypeError(
        f"{where}: dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, torch.float16), "
        f"got {dtype!r}; integer and bool weights come only from a quantized checkpoint's own tensors"
    )
