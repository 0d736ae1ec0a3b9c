"""Benchmarks of functional-npu, outside the library: ``python -m benchmarks NAME [flags]`` from the repository
root (``python -m benchmarks`` lists the names). They use the library's public and module API only."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment, plus ``extra``, for a child ``python`` that imports ``benchmarks``: the repository
    root first on ``PYTHONPATH`` (the benchmarks are not installed with the package)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)
