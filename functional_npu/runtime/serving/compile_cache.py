"""Compiled graphs saved to a directory, so that a later process starts warm: ``compile_model(..., cache_dir=DIR)``.

Each graph (one per function and input shape: ``forward-1x32-last`` is the forward on tokens ``[1, 32]`` taking the
logits at one position per row, a prefill's; ``forward-1x1`` a decode step) is
compiled ahead of its first call with dynamo's precompile (``torch.compile(fn).aot_compile``), and saved
whole: dynamo's output (the bytecode and its guards), the AOTAutograd and inductor graph, and the C++
kernels it loads. A later process loads it with ``torch.compiler.load_compiled_function`` and runs no
dynamo tracing, no inductor and no C++ compiler. The layout, one directory per rank::

    DIR/<rank>/manifest.json              the key: torch, python, library, model, plan, mesh, shapes, ...
    DIR/<rank>/<key digest>/<graph>/      graph.bin, and inductor/: inductor's cache for that graph alone

``<rank>`` is the rank's place on the mesh, ``dp1of2-tp0of4``.

A graph directory is built under a temporary name beside its final one and renamed into place once
complete, so a killed process leaves only a ``.tmp`` directory that nothing reads (and that the next process on
that host removes once the writer's pid is gone; another host's, once a day old). A manifest whose key differs
(another torch, model, plan, mesh coordinate, shapes, ...), that cannot be read or is not a file, a graph entry
without its ``graph.bin`` or that is not a directory, a graph that cannot be loaded or whose guards reject the
inputs, a directory that cannot be written: each is one warning on the ``functional_npu`` logger naming the
directory and what was wrong, then a clean compile, and the damaged part is replaced so that the next run loads.
A directory that can be read but not written (a shared cache, a read-only mount) whose manifest holds this key is
loaded from, one warning saying so, and left exactly as it is: a graph it lacks or cannot use is compiled, not saved.

While one graph compiles or loads, inductor's cache directory is that graph's own (torch's
``temporary_cache_dir``: ``TORCHINDUCTOR_CACHE_DIR`` set for the call); another thread compiling at the
same moment would share it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import json
import logging
import os
import platform
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ...core.files import write_bytes
from ...core.mesh import Mesh
from ...core.tree import flatten_with_paths
from ...models.decoder import decode
from .backends import Backend

__all__ = [
    "GraphDir",
    "SavedGraphs",
    "cache_key",
    "open_graph_dir",
    "saved_guards",
    "graph_dir",
    "compiled_forward",
    "write_bytes",
    "FORMAT",
    "SAVABLE",
]

log = logging.getLogger("functional_npu")

FORMAT = 1  # of this directory's layout and manifest
MANIFEST = "manifest.json"
GRAPH = "graph.bin"
SAVABLE = ("inductor", "aot_eager")  # the backends whose compiled graphs torch can serialize


def _digest(text: str, n: int = 16) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def _library() -> str:
    """This library's version and a digest of its sources: a changed forward is another library."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for file in sorted(root.rglob("*.py")):
        h.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes())
    try:
        version = metadata.version("functional-npu")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"{version} ({h.hexdigest()[:16]})"


def cache_key(params: dict, mesh: Mesh, placed: Any, shapes: tuple, backend: Any, **fields: Any) -> dict[str, str]:
    """What a saved graph was compiled for, as strings (the manifest's ``key``); a graph is loaded only under an
    equal key. ``params`` are the graphs' own (prepared), ``placed`` their placement; ``shapes`` is (batch buckets,
    max_seq_len, prefill lengths); ``fields`` (kernels, greedy_head, inductor options) are added as their ``repr``."""
    leaves = [
        (p, tuple(x.shape), str(x.dtype), x.stride()) if isinstance(x, torch.Tensor) else (p, repr(x))
        for p, x in flatten_with_paths(params)
    ]
    cfg = placed.config
    return {
        "format": str(FORMAT),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "library": _library(),
        "model": f"{cfg.architecture} {_digest(repr(cfg))}",
        "plan": repr(placed.plan),
        "mesh": f"{mesh.shape} at {mesh.coordinate if mesh.rank is not None else 'no coordinate'}",
        "shapes": f"batch {shapes[0]}, max_seq_len {shapes[1]}, prefill {shapes[2]}",
        "backend": f"{backend.name} mode={backend.mode} on {backend.device_type}",
        "dtype": str(params["embed"].dtype),
        "params": _digest(repr((leaves, placed.quant))),
        "threads": str(torch.get_num_threads()),  # a global-state guard of every graph
        "cpu": torch.backends.cpu.get_cpu_capability(),
        **{k: repr(v) for k, v in fields.items()},
    }


@dataclass(frozen=True)
class GraphDir:
    """One rank's saved graphs under one key: ``root / digest / <graph>``; ``root`` holds the manifest.
    ``read_only``: the directory cannot be written (a shared cache, a read-only mount): its graphs are loaded, and
    nothing in it is saved, replaced or removed."""

    root: Path
    digest: str
    read_only: bool = False

    def path(self, graph: str) -> Path:
        return self.root / self.digest / graph


def _rank_dir(cache_dir: str | os.PathLike, mesh: Mesh) -> Path:
    """``cache_dir / "dp1of2-tp0of4"``: the rank's place on the mesh, so that every rank of a job, and jobs on meshes
    of other shapes, can share ``cache_dir``."""
    if mesh.rank is None:
        return Path(cache_dir) / "-".join(f"{a}of{n}" for a, n in mesh.shape.items())
    return Path(cache_dir) / "-".join(f"{a}{i}of{mesh.shape[a]}" for a, i in mesh.coordinate.items())


def _differences(held: Any, key: Mapping[str, str]) -> str:
    """What a manifest's key says against ``key``, in words (empty when they are equal)."""
    if not isinstance(held, dict) or not isinstance(held.get("key"), dict):
        return "its manifest.json has no key"
    was = held["key"]
    diff = [k for k in key if was.get(k) != key[k]] + [k for k in was if k not in key]
    if not diff:
        return ""
    shown = [f"{k} {was.get(k)!r}, here {key.get(k)!r}" for k in diff if len(str(was.get(k))) <= 48]
    return f"it holds graphs of another {', '.join(diff)}" + (f" ({'; '.join(shown)})" if shown else "")


def open_graph_dir(cache_dir: str | os.PathLike, mesh: Mesh, key: Mapping[str, str]) -> GraphDir | None:
    """This rank's graph directory under ``cache_dir`` for ``key``, its manifest written; a directory whose manifest
    is missing, unreadable or of another key is emptied first. ``None`` when it cannot be written. Either is one
    warning at most."""
    root = _rank_dir(cache_dir, mesh)
    digest = _digest(json.dumps(dict(key), sort_keys=True))
    problem = ""
    try:
        root.mkdir(parents=True, exist_ok=True)
        try:
            _probe(root)
        except OSError as e:
            if e.errno in _READ_ONLY and _holds(root, key):
                log.warning(
                    "compile_model: cache_dir %s cannot be written (%s); loading the graphs it holds, saving none",
                    root,
                    _os_reason(e),
                )
                return GraphDir(root, digest, read_only=True)
            raise
        manifest = root / MANIFEST
        if manifest.is_symlink() or (manifest.exists() and not manifest.is_file()):
            problem = "its manifest.json is not a file"
            _remove(manifest)
        elif manifest.exists():
            try:
                problem = _differences(json.loads(manifest.read_text()), key)
            except (ValueError, UnicodeDecodeError) as e:
                problem = f"its manifest.json cannot be read ({type(e).__name__}: {_line(e)})"
        if problem or not manifest.exists():  # no graph here is trusted: start over
            for old in root.iterdir():
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
            write_bytes(manifest, json.dumps({"format": FORMAT, "key": dict(key)}, indent=1).encode())
        _sweep_staging(root / digest)
    except OSError as e:
        why = f"{problem}; " if problem else ""
        log.warning(
            "compile_model: cache_dir %s cannot be used (%s%s); compiling from scratch, saving nothing",
            root,
            why,
            _os_reason(e),
        )
        return None
    if problem:
        log.warning("compile_model: cache_dir %s: %s; compiling from scratch", root, problem)
    return GraphDir(root, digest)


# what a directory that can be read but not written raises (a read-only mount, another user's directory)
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


def _probe(root: Path) -> None:
    """Raise the OSError a write in ``root`` meets, if any (nothing is left behind)."""
    fd, probe = tempfile.mkstemp(dir=root, prefix=".probe.", suffix=".tmp")
    os.close(fd)
    os.unlink(probe)


def _holds(root: Path, key: Mapping[str, str]) -> bool:
    """Whether ``root``'s manifest is a readable file of exactly ``key``."""
    manifest = root / MANIFEST
    try:
        return (
            manifest.is_file() and not manifest.is_symlink() and not _differences(json.loads(manifest.read_text()), key)
        )
    except (OSError, ValueError, UnicodeDecodeError):
        return False


def _remove(path: Path) -> None:
    """Remove ``path`` whatever it is (a directory tree, a file, a link)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


_HOST = _digest(platform.node(), 8)  # staging names carry the writer's host, so that only its own host judges its pid
_FOREIGN_STAGING_S = 24 * 3600  # a staging directory of another host is removed once this old


def _staging_name(graph: str) -> str:
    return f".{graph}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _sweep_staging(where: Path) -> None:
    """Remove the staging directories under ``where`` that no live writer owns: those of this host whose process is
    gone (a writer killed while it built a graph), and any other host's older than a day."""
    if not where.is_dir():
        return
    now = time.time()
    for entry in where.iterdir():
        parts = entry.name.split(".")
        if not (entry.name.startswith(".") and entry.name.endswith(".tmp") and len(parts) >= 6):
            continue
        host, pid = parts[-4], parts[-3]
        if not pid.isdigit():
            continue
        try:
            stale = not _alive(int(pid)) if host == _HOST else now - entry.lstat().st_mtime > _FOREIGN_STAGING_S
            if stale:
                _remove(entry)
        except OSError:  # removed by another process meanwhile, or not ours to remove: left alone
            continue


def _line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:160] + ("..." if len(text) > 160 else "")


def _os_reason(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, type(e).__name__) if e.errno else type(e).__name__
    return f"{name}: {e.strerror or _line(e)}" + (f": {e.filename}" if e.filename else "")


# what a directory that cannot take a write raises (a full disk, a quota, a read-only or forbidden path)
_STORAGE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EIO}


def _os_error(e: BaseException) -> OSError | None:
    """The storage OSError behind ``e`` (itself, or in its chain of causes), if any."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRORS:
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return None


@contextlib.contextmanager
def _inductor_dir(path: Path) -> Iterator[None]:
    """Inductor's cache directory is ``path`` for the body (and its in-memory caches start empty)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    path.mkdir(parents=True, exist_ok=True)
    with temporary_cache_dir(str(path)):
        yield


def _load(entry: Path) -> Any:
    from torch._guards import TracingContext, tracing

    # a guard on a module (``__import__('torch')...``) installs a guard as it is unpickled, which needs a tracing
    # context; the one given here is dropped after the load
    with _inductor_dir(entry / "inductor"), tracing(TracingContext(None)):
        return torch.compiler.load_compiled_function(io.BytesIO((entry / GRAPH).read_bytes()))


def saved_guards(entries: Sequence[Any]) -> list[bool]:
    """A ``guard_filter_fn`` keeping the guards a precompiled graph can save: none on globals, none on object
    identity or a dict's version (their objects are this process's; the manifest's key stands for them)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [
        not (g.is_global or g.guard_type in unsaved or unsaved.intersection(g.derived_guard_types)) for g in entries
    ]


class SavedGraphs:
    """A forward ``fn(params, tokens, positions, state, mesh[, last])`` whose graphs, one per ``tokens`` shape,
    prefetch ring phase (``state.phase``) and whether ``last`` is given, are loaded from a :class:`GraphDir` when
    saved there, else compiled ahead of the call and saved.

    ``precompile`` is ``torch.compile(fn)`` with the guard filter :func:`saved_guards` (its ``aot_compile`` makes
    each graph), ``fallback`` the plain ``torch.compile(fn)``; ``kwargs`` are the static keywords every call
    passes; ``name`` prefixes the graphs' names. ``loaded`` / ``compiled_now`` list the graphs taken from the
    directory and compiled (and saved) in this process. A write that fails is one warning, and the graphs from
    then on compile through ``fallback``, nothing saved.
    """

    def __init__(self, precompile: Any, fallback: Any, kwargs: Mapping[str, Any], name: str, where: GraphDir) -> None:
        self._precompile, self._fallback, self._kwargs = precompile, fallback, dict(kwargs)
        self._name, self._root = name, where.root
        self._where: GraphDir | None = where  # None once a write failed: nothing more is saved
        self._graphs: dict[tuple[int, ...], Callable[..., Any]] = {}
        self.loaded: list[str] = []
        self.compiled_now: list[str] = []

    def __call__(self, *args: Any) -> Any:
        key = _key(args)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._first(args)
        try:
            return graph(*args, **self._kwargs)
        except RuntimeError as e:  # a saved graph checks its guards first: nothing has run
            if graph is self._fallback or not str(e).startswith("GuardManager check failed"):
                raise
            log.warning(
                "compile_model: cache_dir %s: graph %s rejects these inputs (%s); compiling it as usual",
                self._root,
                self._graph_name(args),
                _line(e),
            )
            self._graphs[key] = self._fallback
            return self._fallback(*args, **self._kwargs)

    def _graph_name(self, args: tuple) -> str:
        shape, phase, last = _key(args)
        return f"{self._name}-{'x'.join(map(str, shape))}" + (f"-phase{phase}" if phase else "") + ("-last" * last)

    def _first(self, args: tuple) -> Callable[..., Any]:
        name = self._graph_name(args)
        if self._where is None:
            return self._fallback
        entry = self._where.path(name)
        if self._where.read_only:
            return self._load_only(name, entry, args)
        if entry.is_symlink() or (entry.exists() and not (entry / GRAPH).is_file()):
            # graphs are published whole by a rename: an entry without its graph.bin was damaged after that
            what = "is not a directory" if entry.is_symlink() or not entry.is_dir() else f"has no {GRAPH}"
            log.warning(
                "compile_model: cache_dir %s: graph %s %s; removing it and compiling it from scratch",
                self._root,
                name,
                what,
            )
            with contextlib.suppress(OSError):
                _remove(entry)
        elif (entry / GRAPH).is_file():
            graph = self._loaded(name, entry, args, "compiling it from scratch")
            if graph is not None:
                return graph
            shutil.rmtree(entry, ignore_errors=True)
        return self._compile(name, entry, args)

    def _load_only(self, name: str, entry: Path, args: tuple) -> Callable[..., Any]:
        """The graph ``name`` from a directory that cannot be written: loaded if it is there and takes these inputs,
        else compiled as usual (one warning for a graph that is there and cannot be used); nothing is touched."""
        if entry.is_symlink() or not (entry / GRAPH).is_file():
            return self._fallback
        graph = self._loaded(name, entry, args, "compiling it, saving nothing (read-only)")
        return self._fallback if graph is None else graph

    def _loaded(self, name: str, entry: Path, args: tuple, otherwise: str) -> Callable[..., Any] | None:
        """The saved graph ``name`` if it loads and its guards take these inputs; else None, after one warning saying
        why and what happens ``otherwise``."""
        try:
            graph = _load(entry)
            if graph.guard_check(*args, **self._kwargs):
                self.loaded.append(name)
                return graph
            reason = "its guards reject these inputs"
        except Exception as e:  # noqa: BLE001 - garbage bytes fail anywhere in unpickling or in the kernels' load
            reason = f"{type(e).__name__}: {_line(e)}"
        log.warning(
            "compile_model: cache_dir %s: graph %s cannot be used (%s); %s", self._root, name, reason, otherwise
        )
        return None

    def _compile(self, name: str, entry: Path, args: tuple) -> Callable[..., Any]:
        staging = entry.with_name(_staging_name(name))
        graph = None
        try:
            with _inductor_dir(staging / "inductor"):
                graph = self._precompile.aot_compile((args, self._kwargs))
            write_bytes(staging / GRAPH, type(graph).serialize(graph).serialized_data)
            _publish(staging, entry)
        except Exception as e:
            shutil.rmtree(staging, ignore_errors=True)
            cause = _os_error(e)
            if cause is None:
                raise  # a graph break, a compiler error: not the directory's doing
            log.warning(
                "compile_model: cache_dir %s cannot be written (%s); graph %s and later ones compile without saving",
                self._root,
                _os_reason(cause),
                name,
            )
            self._where = None
            return self._fallback if graph is None else graph
        self.compiled_now.append(name)
        return graph


def _key(args: tuple) -> tuple[tuple[int, ...], int, bool]:
    """What picks a forward's graph: the tokens' shape, the prefetch ring's phase (a graph per phase, each reading
    the ring's slots in fixed roles: :mod:`functional_npu.parallel.prefetch`) and whether the logits are taken at one
    position per row (``last``, the sixth argument: a prefill's)."""
    return tuple(args[1].shape), args[3].phase.at, len(args) > 5 and args[5] is not None


def _publish(staging: Path, entry: Path) -> None:
    """Rename the complete ``staging`` directory to ``entry``; another process that got there first wins."""
    try:
        os.replace(staging, entry)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        shutil.rmtree(staging, ignore_errors=True)


def graph_dir(cache_dir: Any, params: dict, mesh: Mesh, backend: Backend, *key: Any, **fields: Any) -> Any:
    """This rank's :class:`~.compile_cache.GraphDir` under ``cache_dir`` (None: no saving)."""
    if cache_dir is None or backend.name == "none":
        return None
    if backend.name not in SAVABLE:
        log.warning(
            "compile_model: cache_dir %s is not used: backend %r cannot save its graphs (%s can); compiling as usual",
            cache_dir,
            backend.name,
            " and ".join(SAVABLE),
        )
        return None
    return open_graph_dir(cache_dir, mesh, cache_key(params, mesh, *key, backend, **fields))


def compiled_forward(backend: Backend, static: dict, options: dict, where: Any, name: str) -> Callable[..., Any]:
    """The compiled forward with ``static`` keywords: through saved graphs when ``where`` is a graph directory."""
    if where is None:
        return backend.compile(functools.partial(decode, **static), dynamic=False, inductor_options=options)
    precompile = backend.compile(decode, dynamic=False, inductor_options=options, guard_filter=saved_guards)
    fallback = backend.compile(decode, dynamic=False, inductor_options=options)
    return SavedGraphs(precompile, fallback, static, name, where)
