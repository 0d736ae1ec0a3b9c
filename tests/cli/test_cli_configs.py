"""A malformed config.json or quantization_config on the command line: one line naming the file and the field,
exit 2, before any rank starts (no rank process is left behind, and none was needed to find the fault).

Every case runs through the CLI in this process (its checks run before any rank starts); three, one of each kind
of crash they gave before (a KeyError, a TypeError, an AttributeError), also run as real processes."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from functional_npu.cli.main import main
from tests.support.bad_configs import CASES, write

IN_PROCESSES = ("kv_lora_rank missing", "yarn factor null", "a group not an object")


def _processes_naming(text: str) -> list[int]:
    """Pids of live processes whose command line holds ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="processes are found in /proc (Linux)")
def test_malformed_configs_are_one_line_and_exit_2_in_a_process(tmp_path):
    # each case in its own CLI process, all at once: each must refuse within the deadline
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "functional_npu", "generate", "--model", str(write(tmp_path, name))]
            + ["--prompt-ids", "1,2", "--max-new-tokens", "2", "--timeout", "20"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in IN_PROCESSES
    }
    deadline = time.monotonic() + 120
    errors = {}
    for name, p in procs.items():
        _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        errors[name] = (p.returncode, err)
    for name, (rc, err) in errors.items():
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        assert rc == 2 and "Traceback" not in err and len(lines) == 1, f"{name}: rc {rc}\n{err}"
        folder = str(tmp_path / name.replace(" ", "_"))
        assert f"error: {folder}/config.json: " in lines[0] and CASES[name][1] in lines[0], f"{name}: {lines[0]}"
    assert not _processes_naming(str(tmp_path)), "a process of a refused run is still alive"


@pytest.mark.parametrize("name", list(CASES))
def test_each_malformed_config_is_one_line_and_exit_2(tmp_path, name, capsys):
    folder = write(tmp_path, name)
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(folder), "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert exit_.value.code == 2 and len(lines) == 1
    assert f"error: {folder}/config.json: " in lines[0] and CASES[name][1] in lines[0], lines[0]
