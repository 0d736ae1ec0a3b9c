"""A run ends with its parent: SIGTERM, SIGKILL or Ctrl-C to `python -m functional_npu demo` leaves no rank,
no helper process and no temporary directory behind. Processes are found by process group (the run gets a
session of its own), never by name; every wait has a deadline."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..support.cli import live_in_group as _group


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background job's ignored SIGINT would be inherited


def _left(tmp: Path) -> list[Path]:
    """What the run left in its TMPDIR, but inductor's compile cache (``torchinductor_<user>``), which is
    meant to outlive runs and which inductor itself may place there."""
    return [p for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]


def _wait_for(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"gave up after {seconds:.0f}s waiting for {what}")


def _ended(run: subprocess.Popen, tmp: Path, timeout: float = 120) -> int:
    """Wait for the run, its processes and its temporary files to end; returns its exit code."""
    try:
        code = run.wait(timeout=timeout)
        _wait_for(lambda: not _group(run.pid), 15, f"the processes of the run to end: {_group(run.pid)}")
        _wait_for(lambda: not _left(tmp), 15, f"the temporary files to go: {_left(tmp)}")
    finally:
        if _group(run.pid):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=30)
    return code


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process groups are read from /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_parent_ends_the_whole_run(tmp_path, sig):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        run = subprocess.Popen(
            [sys.executable, "-m", "functional_npu", "demo", "--tp", "2", "--timeout", "120"],
            env=os.environ | {"TMPDIR": str(tmp)},
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,  # its own process group: the run's processes are exactly that group
            preexec_fn=_default_sigint,  # as from a terminal, even where this test runs with SIGINT ignored
        )
        try:
            _wait_for(lambda: len(_group(run.pid)) >= 3, 180, "the demo's two ranks to start")
            time.sleep(4)  # into the run: the ranks are loading, generating or compiling
            if sig == signal.SIGINT:
                os.killpg(run.pid, sig)  # Ctrl-C reaches the whole foreground group
            else:
                os.kill(run.pid, sig)  # only the parent
            code = _ended(run, tmp, timeout=60)
        finally:
            if _group(run.pid):
                os.killpg(run.pid, signal.SIGKILL)
                run.wait(timeout=30)
    stderr = log.read_text()
    assert code == {signal.SIGTERM: 143, signal.SIGKILL: -9, signal.SIGINT: 130}[sig], stderr
    assert "Traceback" not in stderr, stderr
    if sig == signal.SIGINT:
        # multiprocessing's resource tracker (it ignores Ctrl-C) may report, as it exits after the parent, that it
        # cleaned up the semaphores of queues whose rank was killed mid-call: its words, not the run's
        own = [line for line in stderr.strip().splitlines() if "resource_tracker" not in line]
        assert own[-1] == "interrupted", stderr
