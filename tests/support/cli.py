"""The command line as the CLI tests drive it: a subprocess run, ``generate --json`` over prompts, refusals."""

import json
import subprocess
import sys

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
