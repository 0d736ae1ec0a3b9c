"""What the command line says when its ranks fail, for ``generate`` and ``demo`` alike: one line on stderr
(``error: ...``) and exit code 1, never a traceback.

A rank that raised is named with its exception's whole message (a mismatch report spans lines: they are joined);
a rank that died, or ranks that gave no answer within ``--timeout`` (and the fix), are said as
:class:`~functional_npu.runtime.launch.LocalWorld` says them.
"""

from __future__ import annotations

import re
import sys

from ..runtime.launch import RemoteError

__all__ = ["WORLD_ERRORS", "world_failed"]

# what LocalWorld raises when a rank raises (RemoteError), dies (RuntimeError) or does not answer (TimeoutError)
WORLD_ERRORS = (RemoteError, TimeoutError, RuntimeError)


def world_failed(error: BaseException) -> int:
    """Print ``error`` (one of :data:`WORLD_ERRORS`) as one line on stderr; returns the exit code, 1."""
    said = str(error)
    if isinstance(error, RemoteError):
        agreed = re.fullmatch(r"(\w+): rank (\d+): (.*)", error.summary, re.S)  # every rank raised rank N's error
        said = (
            f"rank {agreed[2]} raised {agreed[1]}: {agreed[3]}"
            if agreed
            else f"rank {error.rank} raised {error.summary}"
        )
    fix = "; give the ranks more time with --timeout" if isinstance(error, TimeoutError) else ""
    print("error: " + " ".join(said.split()) + fix, file=sys.stderr)
    return 1
