"""Fair timing on a shared machine, for every benchmark: interleaved rounds, medians with their spread.

Every system is built and warmed first; then each round runs every system once in turn (A B C A B C ...), so
drift on a shared machine hits all alike, and each figure is the median over the rounds with its spread (min,
max). Decode tokens/s at batch ``b`` are ``b (N - 1) / (T(N new tokens) - T(1 new token))``, so prefill is
excluded from decode and vice versa. Every function that reads a clock takes it as an argument (tests pass a
fake one).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

__all__ = [
    "seconds",
    "best_time",
    "rounds",
    "generate_times",
    "rates",
    "interleaved",
    "stats",
    "ratio",
    "pin_threads",
    "read_bandwidth",
]

T = TypeVar("T")
Clock = Callable[[], float]


def seconds(fn: Callable[[], Any], *, clock: Clock = time.perf_counter) -> float:
    """One timing of ``fn()`` on ``clock`` (default: wall-clock seconds)."""
    t0 = clock()
    fn()
    return clock() - t0


def best_time(fn: Callable[[], Any], repeat: int = 5, *, clock: Clock = time.perf_counter) -> float:
    """The fastest of ``repeat`` timings of ``fn()`` on ``clock`` (default: wall-clock seconds)."""
    return min(seconds(fn, clock=clock) for _ in range(repeat))


def rounds(
    systems: Mapping[str, Callable[[], T]],
    repeat: int,
    *,
    warmup: int = 0,
    between: Callable[[int], None] | None = None,
) -> dict[str, list[T]]:
    """``warmup`` untimed rounds, then ``repeat`` rounds, each calling every system once in turn (A B C A B C
    ...): ``{system: [its result in each round]}``; ``between(r)`` runs after round ``r``."""
    out: dict[str, list[T]] = {name: [] for name in systems}
    for r in range(warmup + repeat):
        for name, fn in systems.items():
            result = fn()
            if r >= warmup:
                out[name].append(result)
        if between is not None and r >= warmup:
            between(r - warmup)
    return out


def generate_times(run: Callable[[int], Any], new: int, *, clock: Clock = time.perf_counter) -> tuple[float, float]:
    """``(T(new), T(1))``: one timing each of ``run(new)`` and ``run(1)`` (``n`` new tokens), a round's sample of
    the decode step ``(T(new) - T(1)) / (new - 1)``."""
    return seconds(lambda: run(new), clock=clock), seconds(lambda: run(1), clock=clock)


def rates(
    run: Callable[[int, int], Any], b: int, new: int, prompt_len: int, *, clock: Clock = time.perf_counter
) -> tuple[float, float]:
    """(decode, prefill) tokens/s at batch ``b``: ``b (N - 1) / (T(N) - T(1))`` and ``b P / T(1)``, each
    time the best of two on ``clock``."""
    t_one = best_time(lambda: run(b, 1), 2, clock=clock)
    return b * (new - 1) / max(best_time(lambda: run(b, new), 2, clock=clock) - t_one, 1e-9), b * prompt_len / t_one


def interleaved(
    systems: dict[str, Callable[[int, int], Any]],
    batches: tuple[int, ...],
    new: int,
    prompt_len: int,
    repeat: int,
    between: Callable[[int], None] | None = None,
) -> dict[str, dict[int, dict[str, list[float]]]]:
    """:func:`rates` of every system at every batch in ``repeat`` :func:`rounds`: ``{system: {batch: {"decode":
    [...], "prefill": [...]}}}``, one entry per round; ``between(r)`` runs after round ``r``."""
    per_round = rounds(
        {name: lambda run=run: [rates(run, b, new, prompt_len) for b in batches] for name, run in systems.items()},
        repeat,
        between=between,
    )
    return {
        name: {
            b: {"decode": [r[i][0] for r in runs], "prefill": [r[i][1] for r in runs]} for i, b in enumerate(batches)
        }
        for name, runs in per_round.items()
    }


def stats(xs: list[float]) -> dict[str, Any]:
    """Median, min, max and every run."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def ratio(ours: list[float], theirs: list[float]) -> dict[str, float]:
    """``ours / theirs`` round by round (both measured in the same round): median, min and max."""
    per = [a / b for a, b in zip(ours, theirs)]
    return {"median": statistics.median(per), "min": min(per), "max": max(per)}


def pin_threads(threads: int | None) -> list[int]:
    """Pin this process to ``threads`` cores (default: all it may use) and as many torch threads."""
    cores = sorted(os.sched_getaffinity(0))[: threads or None]
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return cores


def read_bandwidth(mib: int = 512, repeat: int = 5) -> float:
    """Bytes/s of a plain streaming read over all threads: a sum over a float32 buffer of ``mib`` MiB, far larger
    than the caches, the fastest of ``repeat``. What the memory delivers to a kernel that only reads, and so
    the physical limit of a decode step that reads each weight once (the roofline)."""
    x = torch.ones(mib * 2**18)
    x.sum()
    return x.numel() * x.element_size() / best_time(x.sum, repeat)
