"""What a count or a figure given by a user must be, as predicates the one-line refusals share: an int that is not a
bool (``True`` is an ``int`` to Python), a real number that is finite (``NaN < 0`` is False, so a range check alone
lets NaN through)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["is_int", "is_finite"]


def is_int(v: Any, low: int | None = None, high: int | None = None) -> bool:
    """``v`` an int, not a bool, in ``[low, high]`` (either bound None: unbounded on that side)."""
    return isinstance(v, int) and not isinstance(v, bool) and (low is None or v >= low) and (high is None or v <= high)


def is_finite(v: Any) -> bool:
    """``v`` an int or float, not a bool, neither NaN nor infinite."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
