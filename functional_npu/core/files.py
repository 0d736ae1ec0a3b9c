"""A file written whole or not at all: the one atomic write the library's caches and plan files use.

The write goes to a temporary file beside the target, then ``os.replace`` puts it in the target's place. That
replaces whatever directory entry is there, so the target must be a regular file this process may write, or no
entry at all: a symbolic link, a FIFO, a device node (``/dev/null`` run as root), a socket or a directory is refused
before anything is written (:func:`check_target`), never turned into a regular file holding the data.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["write_bytes", "check_target", "NotARegularFile"]

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotARegularFile(OSError):
    """The target of an atomic write is there and is not a regular file it may replace (``strerror`` says what)."""


def check_target(path: Path) -> None:
    """Refuse a ``path`` an atomic write must not replace: an entry that is not a regular file (``lstat``: a link is
    not followed), or a regular file this process may not write.

    Raises:
        NotARegularFile: one line naming the path, what it is and the fix.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    for test, kind in _KINDS:
        if test(mode):
            raise NotARegularFile(
                errno.EEXIST,
                f"{path} is {kind}, not a regular file: writing it whole would replace it with one; give the path of "
                f"a regular file or of a new one",
            )
    if not os.access(path, os.W_OK):
        raise NotARegularFile(
            errno.EACCES, f"{path} is a file this process may not write: replacing it would bypass its permissions"
        )


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file in the same directory, then ``os.replace``; a write that
    fails (a full device, a kill) leaves the old file, or none, and no temporary file. A ``path`` that is not a regular
    file this process may write is refused first (:func:`check_target`)."""
    path = Path(path)
    check_target(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
