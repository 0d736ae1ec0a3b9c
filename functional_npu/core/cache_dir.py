"""Where the library keeps what it computes once per machine (torchair's sources, the host's profile)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["cache_dir", "cache_problem"]


def cache_dir() -> Path:
    """``$FUNCTIONAL_NPU_CACHE``, or ``~/.cache/functional_npu``."""
    return Path(os.environ.get("FUNCTIONAL_NPU_CACHE") or Path.home() / ".cache" / "functional_npu")


def cache_problem(path: Path) -> str | None:
    """Why ``path`` (a directory under :func:`cache_dir`) cannot be made or written, in words that name
    ``FUNCTIONAL_NPU_CACHE`` and the fix; None when it can. Nothing is created."""
    where = f"the cache directory {path}"
    fix = "set FUNCTIONAL_NPU_CACHE to a writable directory"
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                return f"{where} cannot be made: {p} is not a directory; {fix}"
            if not os.access(p, os.W_OK | os.X_OK):
                return f"{where} cannot be written: {p} is not writable ({errno.errorcode[errno.EACCES]}); {fix}"
            return None
    return None
