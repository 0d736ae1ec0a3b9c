"""A run's scratch directory, which the next run removes if its owner was killed before it could.

A run ended by SIGTERM or Ctrl-C removes its directory as it unwinds, and once its ranks have started their
watchdog (:func:`~functional_npu.runtime.launch.watch_parent`) removes it if the run is SIGKILLed; before that, a
SIGKILL leaves no process to remove it. So the directory is named after its owner,
``functional-npu-<what>-<pid>-<start>-XXXXXXXX`` in the temporary directory (``<start>``: the process's start
time in ``/proc``, which tells the owner from a later process given the same pid), and every run first removes the
directories whose owner is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["scratch_dir", "remove_orphaned"]

_PREFIX = "functional-npu-"


@contextlib.contextmanager
def scratch_dir(what: str) -> Iterator[str]:
    """A new directory for this run in the temporary directory, removed when the run ends; the directories of
    every run (of any kind: a ``post-train`` run's are removed by the next ``demo``) that was killed are removed
    first."""
    remove_orphaned()
    pid = os.getpid()
    path = tempfile.mkdtemp(prefix=f"{_PREFIX}{what}-{pid}-{_start_time(pid) or 0}-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def remove_orphaned(what: str | None = None, root: str | Path | None = None) -> list[Path]:
    """Remove this user's scratch directories (of ``what`` runs; None: of every kind) in ``root`` (default: the
    temporary directory) whose owner is no longer running; returns them."""
    kind = re.escape(what) if what is not None else r"[a-z][a-z-]*?"
    named = re.compile(rf"{re.escape(_PREFIX)}({kind})-(\d+)-(\d+)-[^-]+$")
    removed = []
    for entry in Path(root or tempfile.gettempdir()).glob(f"{_PREFIX}{what or ''}*"):
        m = named.match(entry.name)
        try:
            mine = entry.is_dir() and not entry.is_symlink() and entry.stat().st_uid == os.getuid()
        except OSError:  # removed meanwhile
            continue
        if m and mine and not _running(int(m[2]), m[3]):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot: field 22 of ``/proc/<pid>/stat``); None if there is
    no such process or no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]  # the fields after the name start at field 3


def _running(pid: int, start: str) -> bool:
    """Whether the process that made a directory (``pid``, started at ``start``) still runs."""
    if Path("/proc/self/stat").exists():
        return _start_time(pid) == start
    try:  # no /proc: a live process with that pid counts as the owner
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
