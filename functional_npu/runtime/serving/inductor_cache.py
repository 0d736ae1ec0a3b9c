"""Inductor's compile cache healed of the shared objects a killed compile left half-written.

Inductor builds each C++ kernel straight to its final path (``<root>/<2 chars>/<key>.so``, the compiler's
``-o``) and, later, builds it only if that path does not exist. A process killed while the compiler writes
(a rank stopped by :class:`~functional_npu.runtime.launch.LocalWorld`, a Ctrl-C, a ``kill -9`` of the
whole run) leaves a zero-byte or truncated ``.so`` that every later compile of that graph trusts: loading
it fails with ``ImportError: ... file too short``, or the process dies of SIGBUS on a truncated one, until
the cache is deleted by hand.

:func:`incomplete_objects` finds such files: too short for an ELF header, not ELF, or an ELF whose header
places its program headers, a segment or its section headers beyond the file's end. :func:`sweep` removes
them with the build directory beside each, holding inductor's own build lock for the file (``locks/<key>.lock``,
an ``flock``) so a build that a live process runs right now is never touched. The library sweeps after it
kills ranks, when a world starts and before an inductor compile, so a cache left by a process killed outside
the library is healed too.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["incomplete_objects", "inductor_root", "sweep"]

_PATTERNS = ("*/*.so", "*/*.o")  # inductor's layout for CPU kernels: <root>/<key[1:3]>/<key>[.main].{so,o}
_BUILD_DIR = "_CxxBuild"  # inductor's build directory beside its target: <root>/<xx>/<name>_CxxBuild
_HEAD = 4096  # the ELF header and, as compilers write them, the program headers right after it


def inductor_root() -> Path:
    """The directory inductor caches in for this process and the ranks it starts: ``$TORCHINDUCTOR_CACHE_DIR``
    or inductor's default, ``<tmp>/torchinductor_<user>`` (as ``torch._inductor.runtime.cache_dir_utils`` says,
    without importing inductor, which costs a second; read, never created)."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if root is None:
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            user = f"uid_{os.getuid()}"
        root = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    return Path(root).absolute()


def _elf_end(head: bytes) -> int | None:
    """How many bytes the ELF whose first bytes are ``head`` must hold (its program headers and segments as
    far as ``head`` lists them, and its section headers); None if ``head`` is not an ELF header."""
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
        return None
    wide, end = head[4] == 2, "<" if head[5] == 1 else ">"
    if wide and len(head) < 64:
        return None
    if wide:
        phoff, shoff = struct.unpack_from(end + "QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", head, 0x36)
    else:
        phoff, shoff = struct.unpack_from(end + "II", head, 0x1C)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", head, 0x2A)
    need = max(phoff + phnum * phentsize, shoff + shnum * shentsize)
    segment = (end + "Q16xQ", 8) if wide else (end + "I8xI", 4)  # (p_offset, p_filesz) and where they start
    for at in range(phoff, min(phoff + phnum * phentsize, len(head) - phentsize + 1), phentsize or 1):
        offset, size = struct.unpack_from(segment[0], head, at + segment[1])
        need = max(need, offset + size)
    return need


def _incomplete(path: Path, since: float | None = None) -> bool:
    """Whether ``path`` is an object a killed build left: its header is read only for a suspect (shorter than an
    ELF header, an object file, a shared object without the execute bits the linker sets once it is done, or
    one modified at or after ``since``), so a sweep of a large cache costs a ``stat`` per file."""
    try:
        st = path.stat()
        suspect = st.st_size < 64 or path.suffix == ".o" or not st.st_mode & 0o111
        if not (suspect or (since is not None and st.st_mtime >= since)):
            return False
        with open(path, "rb") as f:
            head = f.read(_HEAD)
    except OSError:  # gone meanwhile, or unreadable: nothing this sweep can judge
        return False
    need = _elf_end(head)
    return need is None or need > st.st_size


def incomplete_objects(root: str | os.PathLike, since: float | None = None) -> list[Path]:
    """The shared objects and object files under inductor cache ``root`` that a killed compile left incomplete:
    zero bytes, not ELF, or an ELF that extends beyond the file's end. A shared object with its execute bits set
    (GNU ld sets them as it closes a complete output) is read only if modified at or after ``since``."""
    root = Path(root)
    return sorted(p for pattern in _PATTERNS for p in root.glob(pattern) if _incomplete(p, since))


@contextlib.contextmanager
def _build_lock(root: Path, target: Path) -> Iterator[bool]:
    """Inductor's build lock for ``target`` (``root/locks/<key>.lock``, ``key`` the name up to its first dot),
    taken without waiting: yields whether it was free, i.e. no live process is building ``target`` now."""
    lock = root / "locks" / f"{target.name.split('.')[0]}.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # no lock directory: nothing has locked it
        yield True
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def sweep(root: str | os.PathLike | None = None, since: float | None = None) -> list[Path]:
    """Remove the incomplete objects under inductor cache ``root`` (default :func:`inductor_root`), and the
    build directory beside each, unless a live process holds its build lock. ``since`` (a ``time.time()``, e.g.
    when the processes just killed started) also checks every object modified from then on. Returns what was
    removed."""
    root = Path(root) if root is not None else inductor_root()
    removed = []
    for path in incomplete_objects(root, since):
        with contextlib.suppress(OSError), _build_lock(root, path) as free:
            if free and _incomplete(path, since):  # still incomplete, now that no build can be writing it
                path.unlink()
                removed.append(path)
                shutil.rmtree(path.with_name(path.name.rsplit(".", 1)[0] + _BUILD_DIR), ignore_errors=True)
    return removed
