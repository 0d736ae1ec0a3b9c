"""The README's main job, run as a user runs it, and its argument errors."""

import subprocess
import sys

import pytest


def _cli(*args: str, timeout: float = 600):
    return subprocess.run([sys.executable, "-m", "functional_npu", *args], capture_output=True, text=True, timeout=timeout)


def test_demo_runs_and_verifies_on_two_ranks():
    out = _cli("demo", "--dp", "1", "--tp", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo: OK" in out.stdout
    assert out.stdout.count("| True |") == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["demo", "--tp", "3"], "--tp 3: the demo model has 2 KV heads, so tp must divide 2 or be a multiple of 2"),
        (["demo", "--dp", "0"], "argument --dp: expected a positive integer, got 0"),
        (["demo", "--dp", "x"], "argument --dp: expected a positive integer, got 'x'"),
        (["nonsense"], "invalid choice: 'nonsense'"),
    ],
)
def test_bad_arguments_are_one_clear_line_and_exit_2(args, message):
    out = _cli(*args, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr
