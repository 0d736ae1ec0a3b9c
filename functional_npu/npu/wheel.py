"""torchair's Python sources, from the torch-npu wheel, unpacked into a cache (never installed).

Installing torch-npu where ``import torch`` must work breaks it on a host without CANN. The graph
conversion needs only the wheel's ``torch_npu/dynamo`` directory (torchair and its converters), so
:func:`torchair_sources` downloads the wheel with ``pip download --no-deps`` (once per machine),
unpacks that directory without its native ``.so`` files into the cache, and returns its path.

The cache is ``$FUNCTIONAL_NPU_CACHE`` or ``~/.cache/functional_npu``; a wheel already on disk can
be named with ``$FUNCTIONAL_NPU_TORCH_NPU_WHEEL`` (no download).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["TORCH_NPU_VERSION", "TorchairUnavailable", "cache_dir", "torchair_sources", "unpack"]

TORCH_NPU_VERSION = "2.13.0"  # the torch-npu release matching this project's torch line
_PREFIX = "torch_npu/dynamo/"
_DONE = ".unpacked"  # written last: a directory without it is an interrupted unpack
# the wheel's tags follow the interpreter; any build holds the same Python sources
_FALLBACK_TAGS = ("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", "--only-binary=:all:")


class TorchairUnavailable(RuntimeError):
    """torchair's sources could not be obtained; the message is one line saying why and what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("FUNCTIONAL_NPU_CACHE") or Path.home() / ".cache" / "functional_npu")


def unpack(wheel: Path, dest: Path) -> Path:
    """Unpack ``torch_npu/dynamo`` (Python and data files, no native modules) from ``wheel`` into
    ``dest`` atomically; returns the ``torch_npu/dynamo`` directory."""
    target = dest / "torch_npu" / "dynamo"
    if (dest / _DONE).is_file():
        return target
    try:
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist() if n.startswith(_PREFIX) and not n.endswith(".so")]
            if not any(n == _PREFIX + "torchair/__init__.py" for n in members):
                raise TorchairUnavailable(f"{wheel} holds no {_PREFIX}torchair package; is it a torch-npu wheel?")
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
            try:
                z.extractall(tmp, members=members)
                (tmp / _DONE).write_text(f"{wheel.name}\n")
                if dest.exists():  # an interrupted earlier unpack
                    shutil.rmtree(dest)
                os.replace(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except (zipfile.BadZipFile, OSError) as e:
        raise TorchairUnavailable(f"cannot unpack {wheel}: {e}") from None
    return target


def _download(version: str, into: Path, timeout: float) -> Path:
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check"]
    base += ["-d", str(into), f"torch-npu=={version}"]
    why = ""
    for extra in ((), _FALLBACK_TAGS):
        try:
            done = subprocess.run(base + list(extra), capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise TorchairUnavailable(f"pip download torch-npu=={version} failed: {e}") from None
        wheels = sorted(into.glob("torch_npu-*.whl"))
        if done.returncode == 0 and wheels:
            return wheels[0]
        why = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
    raise TorchairUnavailable(
        f"could not download torch-npu=={version} ({why}); set FUNCTIONAL_NPU_TORCH_NPU_WHEEL to a downloaded wheel"
    )


def torchair_sources(version: str = TORCH_NPU_VERSION, *, timeout: float = 300.0) -> Path:
    """The unpacked ``torch_npu/dynamo`` directory of torch-npu ``version`` (downloaded on first use).

    Raises:
        TorchairUnavailable: no wheel could be had (offline, pip failed, a bad wheel).
    """
    dest = cache_dir() / f"torchair-{version}"
    if (dest / _DONE).is_file():
        return dest / "torch_npu" / "dynamo"
    local = os.environ.get("FUNCTIONAL_NPU_TORCH_NPU_WHEEL")
    if local:
        if not Path(local).is_file():
            raise TorchairUnavailable(f"FUNCTIONAL_NPU_TORCH_NPU_WHEEL={local} is not a file")
        return unpack(Path(local), dest)
    with tempfile.TemporaryDirectory(prefix="torch-npu-wheel.") as tmp:
        return unpack(_download(version, Path(tmp), timeout), dest)
