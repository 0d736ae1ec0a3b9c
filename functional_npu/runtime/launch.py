"""Local multi-rank worlds: N gloo processes on 127.0.0.1 that run functions on request.

Used by the CLI (which starts its own ranks, no torchrun needed) and by the tests (one world of each
size for the whole session, reused for many cases). Every wait has a deadline: a rank that raises, dies or
hangs fails the call within its timeout, the world is torn down, and the next call starts a
fresh one.

Example:
    >>> def hello(ctx, x):                       # module-level, so it pickles by reference
    ...     return ctx.rank * x
    >>> with LocalWorld(2) as world:             # doctest: +SKIP
    ...     world.run(hello, 10)
    [0, 10]
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import io
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
import torch.utils._pytree as pytree
from tqdm import tqdm

from ..core.mesh import Mesh, make_mesh
from .serving.inductor_cache import sweep

__all__ = ["LocalWorld", "RankContext", "RemoteError", "free_port", "watch_parent"]


_GRACE_S = 2.0  # how long the other ranks' answers are awaited once one rank failed
# what a rank says when a peer, not it, went away: reported only when no rank says more
_ECHO = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Socket Timeout", re.IGNORECASE)


class RemoteError(RuntimeError):
    """A function raised on a rank; carries the rank, the exception as text (``summary``: its type and its
    whole message, every line of it) and the remote traceback."""

    def __init__(self, rank: int, remote_traceback: str, summary: str = ""):
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.summary = summary or (remote_traceback.strip().splitlines() or ["?"])[-1]
        where = f"--- remote traceback (rank {rank}) ---"
        super().__init__(f"rank {rank} raised: {self.summary}\n{where}\n{remote_traceback}")


def _failure() -> tuple[str, str]:
    """(the exception being handled as ``Type: message``, with every line of its message; its traceback)."""
    return "".join(traceback.format_exception_only(*sys.exc_info()[:2])).strip(), traceback.format_exc()


@dataclass
class RankContext:
    """What a function run by :class:`LocalWorld` gets as its first argument, on each rank."""

    rank: int
    world_size: int
    _meshes: dict[tuple[tuple[str, int], ...], Mesh] = field(default_factory=dict, repr=False)

    def mesh(self, axes: Mapping[str, int]) -> Mesh:
        """The world's mesh with these axes, made once per process so its process groups are reused.

        In a single process with no torch.distributed world it is an abstract mesh at rank 0 (every
        axis has size 1, so every collective is the identity).
        """
        key = tuple(axes.items())
        if key not in self._meshes:
            single = self.world_size == 1 and not dist.is_initialized()
            self._meshes[key] = Mesh.abstract(dict(axes), 0) if single else make_mesh(dict(axes))
        return self._meshes[key]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settled(x: Any) -> Any:
    # eager functional collectives return lazily-waited tensors; serialization must see the data
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


def _encode(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(pytree.tree_map(_settled, obj), buf)
    return buf.getvalue()


def _decode(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def watch_parent(parent: int, remove: tuple[str, ...] = ()) -> None:
    """End this process as soon as the process that started it is gone, whatever ended it (SIGKILL included):
    remove the paths the run owns, then exit. Polls the parent pid, which works on every platform."""
    while os.getppid() == parent:
        time.sleep(0.2)
    for path in remove:
        shutil.rmtree(path, ignore_errors=True)
    os._exit(1)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while processes are started (a spawned process keeps an ignored signal ignored)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _loopback_store(rank: int, world: int, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store on 127.0.0.1 only: rank 0 binds the listening socket itself (the store's own
    server would listen on every interface) and hands it to the store; the other ranks connect to it."""
    if rank:
        return dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    # the store serves on this socket from now on: detached, so Python never closes it under the store
    return dist.TCPStore("127.0.0.1", port, world, True, timeout=timeout, master_listen_fd=listener.detach())


def _send(conn: Any, message: tuple) -> None:
    """Send ``message`` to the parent; a parent that is gone ends this rank quietly (the watchdog's case)."""
    try:
        conn.send_bytes(pickle.dumps(message))
    except OSError:  # BrokenPipeError, ConnectionResetError: nobody is listening any more
        os._exit(1)


def _worker(rank: int, world: int, port: int, conn: Any, threads: int, pg_timeout: float, orphan: tuple) -> None:
    threading.Thread(target=watch_parent, args=orphan, daemon=True, name="parent-watchdog").start()
    faulthandler.enable(all_threads=True)  # a native crash names the Python frames it happened in, on stderr
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile worker pool per rank
    torch.set_num_threads(threads)
    # tqdm's default lock is a named semaphore the resource tracker registers; a rank killed while blocked in a
    # collective never unregisters it, and the parent then warns of leaked semaphores on exit. A rank's bars need
    # only a thread lock.
    tqdm.set_lock(threading.RLock())
    try:
        timeout = datetime.timedelta(seconds=pg_timeout)
        store = _loopback_store(rank, world, port, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    except BaseException:
        _send(conn, (0, rank, "err", _failure()))
        return
    _send(conn, (0, rank, "ok", _encode(None)))
    ctx = RankContext(rank, world)
    while True:
        try:
            task = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the parent is gone (SIGKILL): end quietly, no traceback on its terminal
            os._exit(1)
        if task is None:
            break
        tid, payload = task
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = (tid, rank, "ok", _encode(fn(ctx, *args, **kwargs)))
        except BaseException:
            result = (tid, rank, "err", _failure())
        _send(conn, result)
    dist.destroy_process_group()
    # Nothing is left to save: skip the interpreter's teardown, which frees every compiled graph one object at a
    # time (seconds per rank after a compile, paid by every world closed; a fraction of a second without it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class LocalWorld:
    """``world_size`` local gloo ranks; ``run(fn, *args)`` calls ``fn(ctx, *args)`` on each and returns the
    results by rank.

    Args:
        world_size: number of processes.
        timeout: default seconds a ``run`` may take before the world is torn down and an error raised.
        start_timeout: seconds to wait for the processes to start and join the process group.
        threads: torch intra-op threads per rank (default: cores // world_size, at least 1).
        pg_timeout: seconds a collective may block inside a rank before it fails there.
        remove_when_orphaned: paths (e.g. the run's temporary directory) the ranks delete if this process
            dies without closing the world; a rank ends within a fraction of a second of its parent.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 300.0,
        start_timeout: float = 180.0,
        threads: int | None = None,
        pg_timeout: float = 120.0,
        remove_when_orphaned: tuple[str, ...] = (),
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self.pg_timeout = pg_timeout
        self.remove_when_orphaned = tuple(str(p) for p in remove_when_orphaned)
        self._procs: list[Any] = []
        self._conns: list[Any] = []  # the parent's end of each rank's pipe (tasks out, answers in)
        self._tid = 0
        self._started = 0.0  # when the ranks started: a kill sweeps inductor's cache of what they wrote since

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> LocalWorld:
        if self._procs:
            return self
        ctx = mp.get_context("spawn")
        port = free_port()
        sweep()  # what an earlier run killed outside this library left half-written in inductor's cache
        self._started = time.time()
        orphan = (os.getpid(), self.remove_when_orphaned)  # what a rank watches, and removes if the parent dies
        # one pipe per rank, no multiprocessing.Queue: a queue's locks are named semaphores, which the resource
        # tracker reports as leaked (a warning on the user's terminal) whenever this process is SIGKILLed
        pipes = [ctx.Pipe(duplex=True) for _ in range(self.world_size)]
        self._conns = [parent for parent, _ in pipes]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, pipes[r][1], self.threads, self.pg_timeout, orphan),
                daemon=True,
                name=f"fnpu-rank{r}",
            )
            for r in range(self.world_size)
        ]
        with _sigint_ignored():  # inherited from the start: a Ctrl-C during a rank's imports is the parent's to handle
            for p in self._procs:
                p.start()
        for _, child in pipes:
            child.close()  # the ranks hold their ends: a rank that dies is an EOF here
        self._collect(0, self.start_timeout, "start")
        return self

    def close(self, *, kill: bool = False) -> None:
        """Stop the ranks (politely unless ``kill``); idempotent."""
        if not self._procs:
            return
        if not kill:
            for conn in self._conns:
                with contextlib.suppress(OSError):  # a rank that is gone already
                    conn.send_bytes(pickle.dumps(None))
            for p in self._procs:
                p.join(timeout=10)
        killed = [p for p in self._procs if p.is_alive()]
        for p in killed:
            p.kill()
            p.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if killed:  # a rank killed while its compiler wrote leaves a partial object that inductor would trust
            sweep(since=self._started)

    def __enter__(self) -> LocalWorld:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close(kill=exc[0] is not None)

    # ---- running ---------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; returns ``[result of rank 0, rank 1, ...]``.

        Raises:
            RemoteError: a rank raised (the world is restarted on the next call).
            TimeoutError: not every rank answered within ``timeout`` seconds (likewise).
        """
        try:  # pickle here, not in the queue's feeder thread, so a bad task fails now, not at the timeout
            task = pickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(
                f"LocalWorld.run: {getattr(fn, '__qualname__', fn)!r} or its arguments cannot "
                f"be sent to the ranks ({e}); use a module-level function and picklable arguments"
            ) from e
        self.start()
        self._tid += 1
        message = pickle.dumps((self._tid, task))
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:  # the rank is gone: said as a death below
                self._fail(
                    RuntimeError(f"{getattr(fn, '__name__', 'task')}: rank {rank} is gone; the world was stopped")
                )
        return self._collect(self._tid, self.timeout if timeout is None else timeout, getattr(fn, "__name__", "task"))

    def _answers(self, waiting: set[int], timeout: float) -> list[tuple[int, int, str, Any]]:
        """The answers that arrive within ``timeout`` seconds from the ranks ``waiting``; a rank whose pipe is closed
        (it died) is dropped from ``waiting`` and says nothing."""
        conns = {self._conns[r]: r for r in waiting}
        got = []
        for conn in mp_connection.wait(list(conns), timeout=timeout):
            try:
                got.append(pickle.loads(conn.recv_bytes()))
            except (EOFError, OSError):
                waiting.discard(conns[conn])
        return got

    def _collect(self, tid: int, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        got: dict[int, Any] = {}
        waiting = set(range(self.world_size))
        while len(got) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world_size)) - set(got))
                self._fail(
                    TimeoutError(f"{what}: ranks {missing} gave no answer within {timeout:.0f}s; the world was stopped")
                )
            answers = self._answers(waiting, min(left, 0.5))
            if not answers:
                dead = {p.name: p.exitcode for p in self._procs if not p.is_alive()}
                if dead or len(waiting) + len(got) < self.world_size:
                    for p in self._procs:
                        p.join(timeout=0.5)  # a closed pipe comes just before the exit code
                    dead = {p.name: p.exitcode for p in self._procs if not p.is_alive()}
                    self._fail(RuntimeError(f"{what}: processes died {dead} (exit codes); the world was stopped"))
                continue
            for item_tid, rank, status, payload in answers:
                if item_tid != tid:
                    continue  # a late answer to an earlier call
                waiting.discard(rank)
                if status == "err":
                    self._fail(self._cause(tid, rank, payload, set(got), waiting))
                got[rank] = _decode(payload)
        return [got[r] for r in range(self.world_size)]

    def _cause(self, tid: int, rank: int, payload: Any, answered: set[int], waiting: set[int]) -> BaseException:
        """The error to report once ``rank`` failed: the other ranks' answers are awaited for a moment,
        since a rank whose peer died reports only "connection closed by peer"; the first error that is
        not such an echo is the cause, and the others are listed after it."""
        errors = {rank: payload}
        grace = time.monotonic() + _GRACE_S
        while waiting and time.monotonic() < grace:
            answers = self._answers(waiting, 0.1)
            if not answers and any(not proc.is_alive() for proc in self._procs):
                break
            for item_tid, r, status, p in answers:
                if item_tid != tid:
                    continue
                waiting.discard(r)
                if status == "err":
                    errors[r] = p
                else:
                    answered.add(r)
        dead = {p.name: p.exitcode for p in self._procs if not p.is_alive() and p.exitcode not in (0, None)}
        causes = [r for r, (summary, _) in errors.items() if not _ECHO.search(summary)]
        first = min(causes) if causes else rank  # the lowest rank that says more than an echo
        summary, remote_traceback = errors[first]
        # ranks that agreed on one error (functional_npu.core.agree) all say the same: said once
        others = [f"rank {r}: {errors[r][0].splitlines()[0]}" for r in errors if errors[r][0] != summary]
        others += [f"{name} exited with {code}" for name, code in dead.items()]
        if others:
            summary += "\n(also: " + "; ".join(others) + ")"
        return RemoteError(first, remote_traceback, summary)

    def _fail(self, error: BaseException) -> None:
        self.close(kill=True)
        raise error
