"""The benchmarks' argument types: a bad count, figure or list is refused by argparse before anything is measured
(``--repeat 0`` once failed after minutes of compiling and measuring, with a traceback)."""

from __future__ import annotations

import argparse
import math

__all__ = ["count", "non_negative", "positives"]


def count(text: str) -> int:
    """A positive int (rounds, repeats, steps); the benchmarks are applications of their own, so this is theirs, as
    the command line's ``positive`` is its own."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def non_negative(text: str) -> float:
    """A finite number >= 0 (a latency)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}") from None
    if not (math.isfinite(x) and x >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return x


def positives(text: str) -> list[float]:
    """Comma-separated finite numbers > 0 (budgets)."""
    out = []
    for part in text.split(","):
        try:
            x = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers, got {text!r}") from None
        if not (math.isfinite(x) and x > 0):
            raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers, got {text!r} ({part!r})")
        out.append(x)
    return out
