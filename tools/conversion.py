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

__all__ = ["run_conversion"]

ROOT = Path(__file__).resolve().parents[1]


def run_conversion(
    module: str, sources: Path, args: list[str], what: str, timeout: float
) -> tuple[dict[str, Any] | None, list[str]]:
    """Run ``python -m module SOURCES OUT *args``; returns ``(results, problems)``: the JSON it wrote, or None and
    one problem naming ``what`` failed (a timeout, or the process's exit code and the tail of its output)."""
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
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            return None, [f"the {what} process failed (exit {done.returncode}):\n{tail}"]
        return json.loads(out.read_text()), []
