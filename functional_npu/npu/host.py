"""Run torchair's FX-to-GE conversion on a host with no NPU: the process set-up.

torchair's conversion (its GE IR protobuf classes, ``GeGraph``, the ``register_fx_node_ge_converter``
converters and graph passes) is Python; four native modules need CANN. :func:`install` makes the
Python part importable in *this* process, which must be a process of its own (a subprocess started
for the conversion) because it changes the import system:

- the unpacked ``torch_npu/dynamo`` directory goes on ``sys.path`` (``import torchair``);
- ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` so torch does not look for ``torch_npu`` itself;
- every ``import torch_npu`` raises ``ImportError`` and leaves no ``sys.modules`` entry (torchair
  tests ``'torch_npu' in sys.modules`` to decide how to behave);
- the native ``torchair.core._torchair`` is served by :func:`standin`, a Python module whose graph
  object records the serialized GE graph it is asked to load and then raises :class:`HandedToGE`:
  conversion ends exactly where GE would take the graph.

Nothing here is a fake of GE itself: no op compatibility is checked (``check_cann_compat`` accepts
every op, as CANN versions differ), nothing compiles and nothing runs.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path
from typing import Any

__all__ = ["HandedToGE", "handed", "install", "put_on_path", "standin", "BLOCKED", "STANDIN"]

BLOCKED = "torch_npu"  # the package (and its submodules) that must not import here
STANDIN = "torchair.core._torchair"  # the native module replaced by a Python stand-in
_NATIVE = ("torchair.core._npu_graph_executor", "torchair.core._npu_utils", "torchair.core._abi_compat_ge_apis")


class HandedToGE(Exception):  # noqa: N818 - not an error: the point where conversion ends
    """Raised by the stand-in when torchair hands a converted graph to GE.

    torchair re-raises errors as ``type(e)(message)``, so the graph travels apart from the exception:
    :func:`handed` returns what was handed over, in order.
    """


def handed() -> list[tuple[str, bytes]]:
    """``(graph name, serialized GE GraphDef)`` for every graph handed to GE in this process."""
    mod = sys.modules.get(STANDIN)
    return [] if mod is None else list(mod.handed)


class _TorchDataType(enum.IntEnum):
    BOOL = 0
    UINT8 = 1
    INT8 = 2
    INT16 = 3
    UINT16 = 4
    INT32 = 5
    UINT32 = 6
    INT64 = 7
    UINT64 = 8
    BF16 = 9
    FLOAT16 = 10
    FLOAT32 = 11
    FLOAT64 = 12
    COMPLEX64 = 13
    COMPLEX128 = 14


class _GraphBase:
    """What torchair's ``TorchNpuGraph`` derives from: loading hands the graph over (and ends here)."""

    handed: list[tuple[str, bytes]] = []  # replaced per stand-in module (see standin)

    def __init__(self, name: str = "") -> None:
        self.name = name

    def load(self, serialized: bytes, options: dict[str, str], *_: Any) -> None:
        self.handed.append((self.name, bytes(serialized)))
        raise HandedToGE(f"GE graph {self.name!r} ({len(serialized)} bytes) handed to GE")

    def _no_ge(self, *_: Any) -> None:
        raise RuntimeError("GE is not available on this host: the graph was converted, not compiled or run")

    set_hint_shape = compile = auto_tune = run = _no_ge


def standin() -> types.ModuleType:
    """A Python module with the names torchair uses from its native ``_torchair``."""
    mod = types.ModuleType(STANDIN, "Python stand-in for torchair's native module (conversion only)")
    exported: list[bytes] = []
    handed: list[tuple[str, bytes]] = []
    graph_base = type("TorchNpuGraphBase", (_GraphBase,), {"handed": handed})

    def no_op(*_: Any, **__: Any) -> None:
        return None

    def export(graph: bytes, options: dict[str, str]) -> None:
        exported.append(bytes(graph))

    def not_registered(_: str) -> tuple[int, list, list, dict]:
        return 1, [], [], {}  # non-zero status: "no IR definition known", as without CANN's op store

    def unavailable(*_: Any, **__: Any) -> None:
        raise RuntimeError("this torchair feature needs the native module (an NPU host with CANN)")

    mod.__dict__.update(
        InitializeGraphEngine=no_op,
        FinalizeGraphEngine=no_op,
        SetDebugLogPath=no_op,
        InitDeviceStdoutChannel=no_op,
        AclmdlSetDump=no_op,
        AclopStartDumpArgs=no_op,
        AclopStopDumpArgs=no_op,
        GetSocName=lambda: "",
        StupidRepeat=lambda word, times: word * times,
        check_cann_compat=lambda *_: "",
        get_registered_ir_def=not_registered,
        as_torch_tensors=unavailable,
        export=export,
        exported=exported,
        TorchDataType=_TorchDataType,
        TorchNpuGraphBase=graph_base,
        handed=handed,
    )
    return mod


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Refuses ``torch_npu``; serves the stand-in for ``_torchair``; refuses the other native modules."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == BLOCKED or name.startswith(BLOCKED + "."):
            raise ImportError(f"{name} is blocked: torchair runs here for graph conversion only", name=name)
        if name in _NATIVE:
            raise ImportError(f"{name} is native (needs CANN); not available for graph conversion", name=name)
        if name == STANDIN:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return standin()

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def put_on_path(dynamo_dir: Path, package: str, finder: importlib.abc.MetaPathFinder) -> None:
    """Import ``package`` from the wheel's ``dynamo_dir``, with ``finder`` (once per type) answering for
    ``torch_npu`` first, and the device backend autoload off.

    Raises:
        FileNotFoundError: ``dynamo_dir`` holds no ``package``.
    """
    if not (Path(dynamo_dir) / package / "__init__.py").is_file():
        raise FileNotFoundError(f"{dynamo_dir} holds no {package} package (expected {package}/__init__.py)")
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    if not any(type(f) is type(finder) for f in sys.meta_path):
        sys.meta_path.insert(0, finder)
    sys.path.insert(0, str(dynamo_dir))


def install(dynamo_dir: Path) -> None:
    """Make ``import torchair`` work here for conversion.

    Start the process with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (see :func:`environment`) so that
    importing torch does not look for ``torch_npu`` before this runs.

    ``dynamo_dir`` is the unpacked ``torch_npu/dynamo`` directory of the torch-npu wheel.
    """
    if BLOCKED in sys.modules:
        raise RuntimeError(f"{BLOCKED} is already imported in this process; convert in a process without it")
    put_on_path(dynamo_dir, "torchair", _Finder())
