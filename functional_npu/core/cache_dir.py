"""Where the library keeps what it computes once per machine (torchair's sources, the host's profile)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """``$FUNCTIONAL_NPU_CACHE``, or ``~/.cache/functional_npu``."""
    return Path(os.environ.get("FUNCTIONAL_NPU_CACHE") or Path.home() / ".cache" / "functional_npu")
