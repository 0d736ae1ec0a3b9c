"""The repository passes its linter and formatter (ruff, configured in pyproject.toml; installed by the test extra)."""

import subprocess
import sys

from .support import ROOT


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check_passes():
    out = _ruff("check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_is_clean():
    out = _ruff("format", "--check", ".")
    assert out.returncode == 0, out.stdout + out.stderr
