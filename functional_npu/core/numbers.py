"""What a count or a figure given by a user must be, as predicates the one-line refusals share: an int that is not a
bool (``True`` is an ``int`` to Python), a real number that is finite (``NaN < 0`` is False, so a range check alone
lets NaN through)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["is_int", "is_finite", "require_int"]


def is_int(v: Any, low: int | None = None, high: int | None = None) -> bool:
    """``v`` an int, not a bool, in ``[low, high]`` (either bound None: unbounded on that side)."""
    return isinstance(v, int) and not isinstance(v, bool) and (low is None or v >= low) and (high is None or v <= high)


def is_finite(v: Any) -> bool:
    """``v`` an int or float, not a bool, neither NaN nor infinite."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def require_int(value: Any, what: str, least: int, meaning: str = "") -> int:
    """``value`` if it is an int (not a bool) >= ``least``; else a one-line TypeError (not an int) or ValueError
    (too small): "``what`` must be an int >= ``least`` (``meaning``), got ...", the parenthesis only with a
    ``meaning``."""
    need = f"{what} must be an int >= {least}" + (f" ({meaning})" if meaning else "")
    if not is_int(value):
        raise TypeError(f"{need}, got {type(value).__name__} {value!r}")
    if value < least:
        raise ValueError(f"{need}, got {value}")
    return value
