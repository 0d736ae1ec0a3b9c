"""The multi-rank harness fails fast: remote errors carry their rank, hangs and dead ranks time out."""

import contextlib
import os
import time

import pytest

from functional_npu.runtime.launch import LocalWorld, RemoteError

from ..support.workers import listening_addresses


def _rank_times(ctx, x):
    return ctx.rank * x


def _raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise ValueError("bad input on purpose")
    return "ok"


def _hang_on_rank0(ctx):
    if ctx.rank == 0:
        time.sleep(600)
    return "ok"


def _die_on_rank1(ctx):
    if ctx.rank == 1:
        os._exit(3)
    time.sleep(600)


def test_results_come_back_by_rank(world2):
    assert world2.run(_rank_times, 10) == [0, 10]


def test_remote_error_names_rank_and_message_then_world_restarts(world2):
    with pytest.raises(RemoteError, match=r"rank 1 raised: ValueError: bad input on purpose"):
        world2.run(_raise_on_rank1)
    assert world2.run(_rank_times, 3) == [0, 3]


def _echo_on_rank1_cause_on_rank0(ctx):
    if ctx.rank == 1:  # what gloo says on a rank whose peer went away
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:21694")
    time.sleep(0.5)
    raise ValueError("the real cause, on rank 0")


def test_the_cause_is_reported_not_its_echo_on_the_peers(world2):
    """The first answer is rank 1's "connection closed by peer"; rank 0's own error, a moment later, is the
    one reported, with the echo listed after it."""
    with pytest.raises(
        RemoteError,
        match=r"rank 0 raised: ValueError: the real cause, on rank 0\n\(also: rank 1: "
        r"RuntimeError: \[pair.cc:553\] Connection closed by peer",
    ):
        world2.run(_echo_on_rank1_cause_on_rank0)
    assert world2.run(_rank_times, 2) == [0, 2]


def test_hang_times_out_instead_of_hanging(world2):
    t0 = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"_hang_on_rank0: ranks \[0\] gave no answer within 3s; the world was stopped"
    ):
        world2.run(_hang_on_rank0, timeout=3)
    assert time.monotonic() - t0 < 30


def test_dead_rank_is_reported(world2):
    with pytest.raises(RuntimeError, match=r"processes died \{'fnpu-rank1': 3\}"):
        world2.run(_die_on_rank1, timeout=60)
    assert world2.run(_rank_times, 1) == [0, 1]


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        LocalWorld(0)


def test_unpicklable_task_fails_at_once(world2):
    t0 = time.monotonic()
    with pytest.raises(
        TypeError, match=r"cannot be sent to the ranks .*use a module-level function and picklable arguments"
    ):
        world2.run(lambda ctx: 1)
    assert time.monotonic() - t0 < 5
    assert world2.run(_rank_times, 2) == [0, 2]


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="socket tables are read from /proc (Linux)")
def test_every_socket_a_local_world_listens_on_is_loopback(world2):
    loopback = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1 and ::1 as /proc/net writes them
    for rank, addresses in enumerate(world2.run(listening_addresses)):
        assert addresses, f"rank {rank} listens on nothing?"
        assert all(a.startswith(loopback) for a in addresses), (rank, addresses)


def test_a_watched_process_ends_with_its_parent(tmp_path):
    """watch_parent (what every rank and the emulated-link benchmark run) ends a process whose parent was
    SIGKILLed, and removes the paths it was given."""
    import signal
    import subprocess
    import sys

    owned = tmp_path / "owned"
    owned.mkdir()
    child = (
        "import os, threading, time\n"
        "from functional_npu.runtime.launch import watch_parent\n"
        "parent = int(os.environ['WATCHED_BY'])\n"
        f"threading.Thread(target=watch_parent, args=(parent, ({str(owned)!r},)), daemon=True).start()\n"
        "print('watching', flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], env=os.environ | {{'WATCHED_BY': str(os.getpid())}}, "
        "stdout=subprocess.PIPE, text=True)\n"
        "assert p.stdout.readline().strip() == 'watching'\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    pid = int(run.stdout.readline())
    os.kill(run.pid, signal.SIGKILL)
    run.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}") and _state(pid) != "Z":
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z", "the child outlived its parent"
    assert not owned.exists()


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_a_world_killed_in_a_collective_leaves_no_semaphore_behind():
    """Ranks that made a progress bar and then blocked in a collective are killed when a peer raises: the parent
    exits with the one error and no resource-tracker warning about leaked semaphores (tqdm's default lock was a
    named semaphore a killed rank never unregistered)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from tests.support.workers import bar_then_refuse_or_wait\n"
        "from functional_npu.runtime.launch import LocalWorld, RemoteError\n"
        "try:\n"
        "    with LocalWorld(2, timeout=60) as w:\n"
        "        w.run(bar_then_refuse_or_wait)\n"
        "except RemoteError as e:\n"
        "    print('error:', e.summary, file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stderr.strip() == "error: ValueError: refused on rank 0", out.stderr


def test_a_sigkilled_parent_leaves_no_rank_and_prints_nothing():
    """The parent of a running world SIGKILLed: its ranks end within the watchdog's poll, and nothing reaches the
    terminal: no rank's EOFError traceback, no resource-tracker warning about leaked semaphores (a
    multiprocessing.Queue's locks are named semaphores; the world now talks over pipes)."""
    import signal
    import subprocess
    import sys

    script = (
        "import os, sys, time\n"
        "from functional_npu.runtime.launch import LocalWorld\n"
        "w = LocalWorld(2, timeout=60).start()\n"
        "print(' '.join(str(p.pid) for p in w._procs), flush=True)\n"
        "time.sleep(120)\n"
    )
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = subprocess.Popen([sys.executable, "-c", script], **pipes, start_new_session=True)
    try:
        ranks = [int(p) for p in run.stdout.readline().split()]
        assert len(ranks) == 2
        os.kill(run.pid, signal.SIGKILL)
        run.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_state(r) not in ("gone", "Z") for r in ranks):
            time.sleep(0.1)
        assert all(_state(r) in ("gone", "Z") for r in ranks), "a rank outlived its parent"
        _, err = run.communicate(timeout=20)  # its stderr closes once every process holding it (the tracker) ended
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
    assert err == "", err
