"""Running a graph conversion in a process of its own (one that never imports the real ``torch_npu``).

:mod:`tools.ge_graphs` (torchair's GE conversion) and :mod:`tools.acl_graphs` (npugraph_ex's passes) both
run ``python -m tools.<module> SOURCES OUT [ARGS...]`` with the device backend autoload off and this
checkout on the path, and read back the JSON it writes to ``OUT``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["failure", "run_conversion"]

ROOT = Path(__file__).resolve().parents[1]


def run_conversion(
    module: str, sources: Path, args: list[str], what: str, timeout: float
) -> tuple[dict[str, Any] | None, list[str]]:
    """Run ``python -m module SOURCES OUT *args``; returns ``(results, problems)``: the JSON it wrote, or None and
    one line naming ``what`` failed (a timeout, or the exit code, the exception raised and a fix)."""
    with tempfile.TemporaryDirectory(prefix=f"functional-npu-{module.rsplit('.', 1)[-1]}.") as tmp:
        out = Path(tmp) / "out.json"
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # it imports tools
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONPATH=path)
        cmd = [sys.executable, "-m", module, str(sources), str(out), *args]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, [f"{what} did not finish in {timeout:.0f} s"]
        if done.returncode != 0 or not out.is_file():
            return None, [failure(what, done.returncode, done.stderr or done.stdout, sources, module)]
        return json.loads(out.read_text()), []


def _raised(output: str) -> str:
    """The exception a traceback in ``output`` ends with (its last ``Name: message`` line), else the last line."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        name = line.split(":", 1)[0]
        if name.replace(".", "").replace("_", "").isalnum() and (name.endswith(("Error", "Exception", "Exit"))):
            return line
    return lines[-1] if lines else "no output"


def failure(what: str, code: int, output: str, sources: Path, module: str) -> str:
    """One line for a conversion process that failed: the exception it raised, where torchair's sources were, and
    what to do, with the command that shows the whole traceback."""
    where = f"torchair's sources at {sources}"
    if "torchair" in output and ("ImportError" in output or "SyntaxError" in output or "ModuleNotFound" in output):
        fix = (
            f"those sources do not import: remove {sources.parents[1]} to unpack the wheel again, or point "
            "FUNCTIONAL_NPU_TORCH_NPU_WHEEL at a good torch-npu wheel"
        )
    else:
        fix = f"the whole traceback: TORCH_DEVICE_BACKEND_AUTOLOAD=0 python -m {module} {sources} OUT.json"
    return f"the {what} process failed (exit {code}): {_raised(output)} ({where}); {fix}"
