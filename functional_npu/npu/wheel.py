"""torchair's Python sources, from the torch-npu wheel, unpacked into a cache (never installed).

Installing torch-npu where ``import torch`` must work breaks it on a host without CANN. The graph
conversion needs only the wheel's ``torch_npu/dynamo`` directory (torchair and its converters), and the capture
checks torch-npu's table of how it implements each op (:data:`OP_TABLE`, ``npu_native_functions_by_codegen.yaml``),
so :func:`torchair_sources` downloads the wheel with ``pip download --no-deps`` (once per machine), unpacks those
without the native ``.so`` files into the cache, and returns the ``dynamo`` directory's path
(:func:`op_table` the table's).

The cache is ``$FUNCTIONAL_NPU_CACHE`` or ``~/.cache/functional_npu``; a wheel already on disk can
be named with ``$FUNCTIONAL_NPU_TORCH_NPU_WHEEL`` (no download). A wheel is unpacked only if its own
``METADATA`` says it is torch-npu of the wanted version; the cache's marker records the wheel's name,
version and digest and the unpacked files' digest, and is checked on every read: a cache whose files
changed, or that holds another wheel than the one named, is unpacked again, never trusted.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..core.cache_dir import cache_dir, cache_problem

__all__ = [
    "TORCH_NPU_VERSION",
    "TorchairUnavailable",
    "cache_dir",
    "cached",
    "torchair_sources",
    "op_table",
    "unpack",
    "OP_TABLE",
]

TORCH_NPU_VERSION = "2.13.0"  # the torch-npu release matching this project's torch line
_PREFIX = "torch_npu/dynamo/"
OP_TABLE = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"  # each op: aclnn (op_api), aclop, or its own
# written last, inside the directory renamed into place: what was unpacked (the wheel's name, version and digest,
# the files' digest); a directory without it, or whose files no longer match it, is unpacked again
_DONE = ".unpacked"
# the wheel's tags follow the interpreter; any build holds the same Python sources
_FALLBACK_TAGS = ("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", "--only-binary=:all:")


class TorchairUnavailable(RuntimeError):
    """torchair's sources could not be obtained; the message is one line saying why and what to do."""


def _is_release(got: str, version: str) -> bool:
    """Whether ``got`` is ``version``, or a post or local build of it (``2.13.0.post1``, ``2.13.0+cpu``)."""
    return re.fullmatch(re.escape(version) + r"(\.post\d+)?(\+[\w.]+)?", got) is not None


def _wheel_release(z: zipfile.ZipFile, wheel: Path, version: str) -> tuple[str, str]:
    """(Name, Version) from the wheel's own ``*.dist-info/METADATA``, whatever the file is called."""
    meta = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
    if len(meta) != 1:
        raise TorchairUnavailable(f"{wheel} has {len(meta)} *.dist-info/METADATA files, not 1; {_fix(version)}")
    fields = email.parser.Parser().parsestr(z.read(meta[0]).decode("utf-8", "replace"), headersonly=True)
    return str(fields.get("Name", "?")), str(fields.get("Version", "?"))


def _digest(files: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for name, data in sorted(files):
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _tree_digest(dest: Path) -> str:
    """The digest of every file under ``dest/torch_npu`` (relative path and contents) but the bytecode Python
    writes beside the sources it imports: what the marker records."""
    files = [f for f in (dest / "torch_npu").rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    return _digest([(str(f.relative_to(dest)), f.read_bytes()) for f in files])


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fix(version: str) -> str:
    return (
        f"point FUNCTIONAL_NPU_TORCH_NPU_WHEEL at the torch-npu {version} wheel "
        f"(pip download --no-deps torch-npu=={version}), or unset it to download that wheel"
    )


def _marker(dest: Path) -> dict | None:
    """What the marker says was unpacked into ``dest``; None if there is no marker. A marker written before
    markers recorded digests (the wheel's file name alone) reads as ``{"wheel": name}``."""
    try:
        text = (dest / _DONE).read_text()
    except (OSError, UnicodeDecodeError):
        return None
    try:
        marker = json.loads(text)
    except json.JSONDecodeError:
        return {"wheel": text.strip()}
    return marker if isinstance(marker, dict) else None


def cached(dest: Path, version: str = TORCH_NPU_VERSION, wheel: Path | None = None) -> Path | None:
    """``dest``'s ``torch_npu/dynamo`` if it holds a complete unpack of torch-npu ``version`` (of ``wheel``, when
    one is named) whose files are unchanged since; None if it must be unpacked again."""
    marker, target = _marker(dest), dest / "torch_npu" / "dynamo"
    if marker is None or not (target / "torchair" / "__init__.py").is_file() or not (dest / OP_TABLE).is_file():
        return None  # an unpack from before the op table was kept is unpacked again
    if "files_sha256" not in marker:  # an older marker: the wheel's file name is all it says
        name = str(marker.get("wheel", ""))
        legacy = wheel is None and re.match(rf"torch_npu-{re.escape(version)}(\.post\d+)?(\+[\w.]+)?-", name)
        return target if legacy else None
    if not _is_release(str(marker.get("version")), version):
        return None
    if wheel is not None and marker.get("wheel_sha256") != _file_digest(wheel):
        return None
    return target if marker["files_sha256"] == _tree_digest(dest) else None


def unpack(wheel: Path, dest: Path, version: str = TORCH_NPU_VERSION) -> Path:
    """Unpack ``torch_npu/dynamo`` (Python and data files, no native modules) and :data:`OP_TABLE` from ``wheel``,
    which must be torch-npu ``version``, into ``dest`` atomically, unless ``dest`` already holds this wheel's
    unchanged unpack; returns the ``torch_npu/dynamo`` directory."""
    try:
        target = cached(dest, version, wheel)
        if target is not None:
            return target
        with zipfile.ZipFile(wheel) as z:
            name, got = _wheel_release(z, wheel, version)
            if re.sub(r"[-_.]+", "_", name).lower() != "torch_npu" or not _is_release(got, version):
                raise TorchairUnavailable(f"{wheel} is {name} {got}, not torch-npu {version}; {_fix(version)}")
            members = [n for n in z.namelist() if n.startswith(_PREFIX) and not n.endswith(".so")]
            if not any(n == _PREFIX + "torchair/__init__.py" for n in members):
                raise TorchairUnavailable(f"{wheel} holds no {_PREFIX}torchair package; is it a torch-npu wheel?")
            if OP_TABLE not in z.namelist():
                raise TorchairUnavailable(f"{wheel} holds no {OP_TABLE}; is it a torch-npu wheel?")
            members.append(OP_TABLE)
            marker = {"wheel": wheel.name, "name": name, "version": got, "wheel_sha256": _file_digest(wheel)}
            try:
                _replace(z, members, dest, marker)
            except OSError as e:  # the destination's fault, not the wheel's
                raise TorchairUnavailable(
                    f"cannot unpack {wheel.name} into {dest}: {e.strerror or e}"
                    f"{f' ({e.filename})' if e.filename else ''}; set FUNCTIONAL_NPU_CACHE to a writable directory"
                ) from None
    except (zipfile.BadZipFile, OSError) as e:
        raise TorchairUnavailable(f"cannot unpack {wheel}: {e}") from None
    return dest / "torch_npu" / "dynamo"


def _replace(z: zipfile.ZipFile, members: list[str], dest: Path, marker: dict) -> None:
    """Extract ``members`` into a fresh directory beside ``dest``, mark it, and rename it over ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        z.extractall(tmp, members=members)
        marker["files_sha256"] = _tree_digest(tmp)
        (tmp / _DONE).write_text(json.dumps(marker))
        if dest.exists():  # an interrupted, changed or other wheel's unpack
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    problem = cache_problem(dest.parent)
    if problem is not None:  # before any download, and not blamed on the wheel
        raise TorchairUnavailable(f"torchair's sources cannot be unpacked: {problem}")
    local = os.environ.get("FUNCTIONAL_NPU_TORCH_NPU_WHEEL")
    if local:  # the named wheel, whatever the cache holds: unpacked again unless the cache holds it unchanged
        if not Path(local).is_file():
            raise TorchairUnavailable(f"FUNCTIONAL_NPU_TORCH_NPU_WHEEL={local} is not a file")
        return unpack(Path(local), dest, version)
    target = cached(dest, version)
    if target is not None:
        return target
    with tempfile.TemporaryDirectory(prefix="torch-npu-wheel.") as tmp:
        return unpack(_download(version, Path(tmp), timeout), dest, version)


def op_table(version: str = TORCH_NPU_VERSION, *, timeout: float = 300.0) -> Path:
    """torch-npu ``version``'s table of how it implements each op (:data:`OP_TABLE`), unpacked beside torchair's
    sources (downloaded on first use, as :func:`torchair_sources`).

    Raises:
        TorchairUnavailable: no wheel could be had.
    """
    return torchair_sources(version, timeout=timeout).parents[1] / OP_TABLE
