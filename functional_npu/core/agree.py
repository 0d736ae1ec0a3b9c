"""Collective agreement on checks whose outcome can differ between ranks.

A function that takes rank-local input (a state dict, DTensor shards, files a rank reads) checks it on each rank.
If only one rank's check fails and it raises, the others walk into the next exchange and wait there for a peer
that never comes, until the process group's timeout. So every rank calls :func:`agree` after its own checks and
before the first exchange: one small ``all_gather_object`` of each rank's outcome, and if any rank failed, every
rank raises the same one-line error, the lowest failing rank's::

    ValueError: rank 0: from_dtensor_state: the state does not match ... missing ['lm_head.weight'] ...; every
    rank stopped before the exchange

On an abstract mesh, a mesh of one rank, or under tracing, nothing is exchanged: the failure is raised as it is.

Example:
    >>> params = agreed(mesh, load_checkpoint_on_this_rank, path, mesh)     # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .mesh import Mesh

__all__ = ["agree", "agreed"]

T = TypeVar("T")

# the error types a failure keeps across ranks (others become a RuntimeError naming their type)
_KINDS = (FileNotFoundError, TypeError, ValueError)


def agree(mesh: Mesh, problem: BaseException | None, *, same: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Every rank of ``mesh`` calls it once its own checks are done, before the first exchange.

    Args:
        mesh: the mesh whose ranks take part (all of them).
        problem: this rank's failed check, or None.
        same: values every rank must hold alike, ``{what: {name: value}}`` (e.g. each tensor's dtype); a
            difference is an error naming ``what``, the name and both ranks' values.

    Raises:
        On every rank the same error when any rank has a ``problem`` (the lowest such rank's, its type kept if it
        is a ValueError, TypeError or FileNotFoundError, else a RuntimeError naming it), or a ValueError when the
        ranks disagree on ``same``. Alone (abstract mesh, one rank, tracing): ``problem`` itself.
    """
    if not isinstance(mesh, Mesh) or mesh.is_abstract or mesh.size == 1 or torch.compiler.is_compiling():
        if problem is not None:
            raise problem
        return
    mine = None if problem is None else _summary(problem)
    got: list[Any] = [None] * mesh.size
    dist.all_gather_object(got, (mine, dict(same or {})), group=_group(mesh))
    failed = [(r, p) for r, (p, _) in enumerate(got) if p is not None]
    if failed:
        r, (kind, message) = failed[0]
        also = f" (ranks {[r for r, _ in failed]} refused)" if len(failed) > 1 else ""
        raise kind(f"rank {r}: {message}{also}; every rank stopped before the exchange") from problem
    difference = _difference([s for _, s in got])
    if difference:
        raise ValueError(f"{difference}; every rank stopped before the exchange")


def agreed(mesh: Mesh, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` with its failure agreed by every rank of ``mesh`` (:func:`agree`): it returns on
    every rank or raises the same error on every rank."""
    try:
        out = fn(*args, **kwargs)
    except Exception as e:
        agree(mesh, e)
        raise  # agree raised already; this is never reached
    agree(mesh, None)
    return out


def _summary(problem: BaseException) -> tuple[type[Exception], str]:
    """(the type every rank raises, the message on one line) of one rank's failure."""
    message = " ".join(str(problem).split())
    kind = next((k for k in _KINDS if isinstance(problem, k)), None)
    return (kind, message) if kind else (RuntimeError, f"{type(problem).__name__}: {message}")


def _difference(sames: list[dict[str, Mapping[str, Any]]]) -> str:
    """The first value a rank holds unlike rank 0, as a sentence; empty if they all agree."""
    for rank, theirs in enumerate(sames[1:], 1):
        for what, values in sames[0].items():
            other = theirs.get(what, {})
            for name in sorted(set(values) | set(other), key=str):
                if values.get(name) != other.get(name):
                    return (
                        f"the ranks disagree on {what}: {name!r} is {other.get(name)!r} on rank {rank} but "
                        f"{values.get(name)!r} on rank 0; give every rank the same input"
                    )
    return ""


def _group(mesh: Mesh) -> Any:
    """The process group over every rank of ``mesh``."""
    return dist.distributed_c10d._resolve_process_group(mesh.group_name(mesh.axis_names))
