"""The demo says what generate says when its ranks fail: a ``--timeout`` too short for a run or a rank SIGKILLed is
one ``error:`` line and exit code 1, no traceback, no process or temporary directory left. A demo SIGKILLed before
its ranks start (no watchdog yet) leaves its checkpoint directory, and the next demo removes it. Real processes, each
in a session of its own; every wait has a deadline; /proc is checked for what is left."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_cli_signals import _default_sigint, _ended, _group, _wait_for

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="processes are read from /proc (Linux)")


def _demo(tmp: Path, *args: str, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """``python -m functional_npu demo --max-new-tokens 2 *args`` with ``TMPDIR=tmp``, in a session of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "functional_npu", "demo", "--max-new-tokens", "2", *args],
        env=os.environ | {"TMPDIR": str(tmp)},
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )


def _scratch(tmp: Path) -> list[Path]:
    """The demo's scratch directories in ``tmp`` (``functional-npu-demo-<pid>-<start>-XXXXXXXX``)."""
    return sorted(tmp.glob("functional-npu-demo-*"))


def _ranks(pid: int) -> list[int]:
    """The pids of the ranks ``pid`` started (its children that multiprocessing's spawn runs)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        kids = [int(c) for c in children.read_text().split()]
    except OSError:
        return []
    out = []
    for kid in kids:
        try:
            if b"spawn_main" in Path(f"/proc/{kid}/cmdline").read_bytes():
                out.append(kid)
        except OSError:
            continue
    return out


def _joined(pid: int) -> bool:
    """Whether rank ``pid`` joined the world: it holds a socket (the rendezvous store's, then gloo's; before that
    only multiprocessing's pipes)."""
    try:
        return any(os.readlink(fd).startswith("socket:") for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def _one_error_line(stderr: str) -> str:
    """The run's one ``error:`` line, the last of its stderr: ranks may print import warnings before it, and
    multiprocessing's resource tracker, which outlives the run by a moment, may report after it the semaphores of the
    queues of ranks that were killed (its words, not the run's)."""
    assert "Traceback" not in stderr, stderr
    own = [line for line in stderr.strip().splitlines() if "resource_tracker" not in line]
    errors = [line for line in own if line.startswith("error:")]
    assert len(errors) == 1 and own[-1] == errors[0], stderr
    return errors[0]


def test_a_demo_killed_before_its_ranks_start_is_cleaned_up_by_the_next_whose_timeout_is_one_line(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    first = _demo(tmp, "--timeout", "2")
    try:  # the tiny model saves and runs its eager pass in about 60 ms: stop the demo the moment its directory shows
        deadline = time.monotonic() + 60  # its own directory: imports may make and remove other files there
        while not _scratch(tmp) and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(first.pid, signal.SIGSTOP)
        left = _scratch(tmp)
        assert left and not _ranks(first.pid)  # no rank yet, so no watchdog
        first.kill()
        first.wait(timeout=30)
    finally:
        if _group(first.pid):
            os.killpg(first.pid, signal.SIGKILL)
    assert all(p.is_dir() for p in left)  # nothing removed it: the next demo must
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        code = _ended(_demo(tmp, "--timeout", "2", stderr=err), tmp)
    assert code == 1
    assert _one_error_line(log.read_text()) == (
        "error: generate_on_rank: ranks [0] gave no answer within 2s; the world was stopped; give the ranks more "
        "time with --timeout"
    )  # the first world the demo starts is the compiled one-rank run's


def test_a_rank_killed_mid_run_is_one_line(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        run = _demo(tmp, "--timeout", "120", stderr=err)
        try:
            ranks = _wait_for(lambda: len(_ranks(run.pid)) == 2 and _ranks(run.pid), 120, "the demo's two ranks")
            _wait_for(lambda: all(map(_joined, ranks)), 120, "the ranks to join the world")
            time.sleep(1)  # into the run: the ranks are joining, loading or generating
            os.kill(ranks[1], signal.SIGKILL)
        except BaseException:
            os.killpg(run.pid, signal.SIGKILL)
            raise
        code = _ended(run, tmp)
    assert code == 1
    line = _one_error_line(log.read_text())  # the rank that died, or its peer's report and then the death
    assert "'fnpu-rank1': -9" in line or "fnpu-rank1 exited with -9" in line, line


def test_only_scratch_directories_whose_owner_is_gone_are_removed(tmp_path):
    from functional_npu.cli.scratch import _start_time, remove_orphaned

    me = os.getpid()
    mine = tmp_path / f"functional-npu-demo-{me}-{_start_time(me)}-abcd1234"
    reused = tmp_path / f"functional-npu-demo-{me}-1-abcd1234"  # this pid, another start time: a pid reused
    gone = tmp_path / f"functional-npu-demo-{2**22 + 1}-5-abcd1234"  # above any pid_max
    other = tmp_path / "functional-npu-demo-notes"  # not a scratch directory's name
    for d in (mine, reused, gone, other):
        d.mkdir()
    assert sorted(remove_orphaned("demo", tmp_path)) == sorted([reused, gone])
    assert mine.is_dir() and other.is_dir() and not reused.exists() and not gone.exists()


def test_a_killed_post_train_runs_scratch_is_removed_by_the_next_run_of_any_kind(tmp_path):
    """A post-train run SIGKILLed before its ranks start leaves its directory; the next plain demo removes it (before:
    only the next post-train run did). A live owner's directory of another kind stays."""
    from functional_npu.cli.scratch import _start_time, remove_orphaned

    me = os.getpid()
    killed = tmp_path / f"functional-npu-post-train-{2**22 + 1}-5-abcd1234"
    live = tmp_path / f"functional-npu-post-train-{me}-{_start_time(me)}-abcd1234"
    conversion = tmp_path / "functional-npu-ge_graphs.abcd1234"  # another tool's temporary directory
    for d in (killed, live, conversion):
        d.mkdir()
    assert remove_orphaned("demo", tmp_path) == []  # one kind only: the other kinds are left
    assert remove_orphaned(root=tmp_path) == [killed]
    assert live.is_dir() and conversion.is_dir()
