"""The command line as the CLI tests drive it: a subprocess run, ``generate --json`` over prompts, refusals."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from functional_npu.cli.main import main

# Prompts of different lengths: with dp 2 the ranks hold 2 and 1 of them.
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [100, 3]]


def cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -m functional_npu *args`` in a fresh process (it starts its own ranks)."""
    return subprocess.run(
        [sys.executable, "-m", "functional_npu", *args], capture_output=True, text=True, timeout=timeout
    )


def generate_json(model, prompts, *args: str) -> dict:
    """``generate --model model *args --json`` with one ``--prompt-ids`` per prompt; must exit 0. Returns the JSON."""
    argv = ["generate", "--model", str(model), *args, "--json"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    out = cli(*argv)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def refused(argv, message: str, capsys) -> None:
    """The CLI in this process (argument checks run before any rank starts): exit 2, one error line."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1


def live_in_group(pgid: int) -> list[int]:
    """Pids of the live processes in process group ``pgid`` (from /proc; zombies are not alive)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def run_in_own_group(argv: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, list[int]]:
    """``python -m functional_npu *argv`` in a process group of its own: (exit code, stderr, pids of the group
    still alive 10 s after it exited). The group is killed if it outlives ``timeout``."""
    run = subprocess.Popen(
        [sys.executable, "-m", "functional_npu", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        _, stderr = run.communicate(timeout=timeout)
        deadline = time.monotonic() + 10
        while live_in_group(run.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        return run.returncode, stderr, live_in_group(run.pid)
    finally:
        if live_in_group(run.pid):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=30)
