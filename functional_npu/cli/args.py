"""The command line's argument types: a bad value is argparse's one line naming the flag (exit code 2)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["positive", "nonnegative", "positive_number"]


def positive(text: str) -> int:
    """A positive integer."""
    return _at_least(text, 1, "a positive integer")


def nonnegative(text: str) -> int:
    """An integer >= 0."""
    return _at_least(text, 0, "an integer >= 0")


def _at_least(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_number(unit: str) -> Callable[[str], float]:
    """A finite number above 0 of ``unit`` (``"seconds"``, ``"gigabytes"``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected a finite number of {unit}, got {text}")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number of {unit}, got {text}")
        return value

    return parse
