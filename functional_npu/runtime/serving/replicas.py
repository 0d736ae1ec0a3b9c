"""Engine replicas: the ranks along data-parallel mesh axes serve requests of their own, in lockstep.

Without replicas a lockstep engine runs one batch on every rank: under a plan whose collectives span a data-parallel
axis (its layer-sharded series fetched from their owners, experts spread over it), every rank along that axis computes
the same rows, and adding ranks adds memory but no throughput. With ``Engine(replicas=axes)`` rank 0 keeps one
scheduler per index along ``axes`` (each with its own requests and the bookkeeping of its own KV pool: every replica's
ranks hold pools of the same size), and each step's calls run together: a call of each kind at the largest of the
replicas' batch buckets (the same shapes on every rank, as the collectives inside need), a replica with no call of
that kind running padding rows that write the null block alone. Each rank runs its own replica's call; the logits
come back to rank 0, which samples every replica's rows with their requests' own samplers.

A replica's requests get the tokens they would get alone: their rows read only their own blocks, and the collectives
that span data-parallel ranks carry weights (the ring's broadcasts) or take each rank's own rows and give them back
(expert dispatch, module TP's exchanges, which were built for data-parallel attention). Tensor parallelism computes
one batch across its axis: replicas over it are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...core.shard import pad_to

__all__ = ["check_replicas", "padded", "gather_logits", "replica_ranks"]


def check_replicas(plan: Any, mesh: Any, axes: Any) -> tuple[tuple[str, ...], int]:
    """``axes`` (one mesh axis or several: a split data-parallel axis, as module TP makes) as a tuple, and the number
    of replicas along them; refused in one line naming the axis: one the mesh lacks, or the plan's tensor-parallel
    axis (its ranks compute one batch together)."""
    names = (axes,) if isinstance(axes, str) else axes
    if not isinstance(names, (tuple, list)) or not names or not all(isinstance(a, str) for a in names):
        raise TypeError(
            f"Engine: replicas must be a mesh axis name or a tuple of them, got {type(axes).__name__} {axes!r}"
        )
    names = tuple(names)
    missing = [a for a in names if a not in mesh.axis_names]
    if missing or len(set(names)) != len(names):
        raise ValueError(
            f"Engine: replicas={axes!r} are not distinct axes of the mesh {mesh.shape} ({missing or 'repeated'}); "
            f"name the data-parallel axes whose ranks serve requests of their own"
        )
    if plan.tp in names and mesh.axis_size(plan.tp) > 1:
        raise ValueError(
            f"Engine: replicas={axes!r} include the plan's tensor-parallel axis {plan.tp!r} (plan.tp): its ranks "
            f"compute one batch together; name the data-parallel axes"
        )
    return names, mesh.axis_size(names)


def replica_ranks(replica_of_rank: Sequence[int], replicas: int) -> list[int]:
    """For each replica, the first rank that serves it (its logits are the replica's: every rank of a replica
    computes the same ones)."""
    firsts = [replica_of_rank.index(r) if r in replica_of_rank else -1 for r in range(replicas)]
    missing = [r for r, rank in enumerate(firsts) if rank < 0]
    if missing:
        raise ValueError(f"Engine: no rank serves replicas {missing} (the ranks' replicas: {list(replica_of_rank)})")
    return firsts


def padded(call: Any, kind: str, batch: int, width: int, ring_width: int, chunk: int) -> Any:
    """``call`` with its rows padded to the ``batch`` bucket (pad rows: token 0 at position 0, every table entry the
    null block), or for None a call of that ``kind`` of padding alone (a decode of one pad row)."""
    from .engine import Call

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else pad_to(t, 0, batch)

    if call is None:
        ring = torch.zeros(batch, ring_width, dtype=torch.long) if ring_width else None
        table = torch.zeros(batch, width, dtype=torch.long)
        if kind == "decode":
            return Call(
                "decode", batch, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), table, ring
            )
        zeros = torch.zeros(batch, chunk, dtype=torch.long)
        return Call("extend", batch, zeros, zeros.clone(), table, ring, last=torch.zeros(batch, dtype=torch.long))
    if call.batch == batch:
        return call
    if kind == "decode":  # tokens [n]: the model pads them to the state's batch
        return Call("decode", batch, call.tokens, call.positions, rows(call.rows), rows(call.ring_rows))
    return Call(
        "extend", batch, rows(call.tokens), rows(call.positions), rows(call.rows), rows(call.ring_rows),
        last=rows(call.last),
    )  # fmt: skip


def gather_logits(out: torch.Tensor, calls: Sequence[Any], firsts: Sequence[int]) -> list[torch.Tensor]:
    """Every rank: its call's logits ``out [n, V]``, padded to its batch, gathered from every rank of the default
    group (the ranks' calls share one batch); each replica's rows (``[n_r, V]``, its first rank's)."""
    batch = calls[0].batch
    mine = pad_to(out, 0, batch)
    every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(every, mine.contiguous())
    return [every[rank][: _rows(call)] for rank, call in zip(firsts, calls)]


def _rows(call: Any) -> int:
    """The rows of logits a call returns: a decode's tokens, an extend's batch."""
    return call.tokens.shape[0] if call.kind == "decode" else call.batch
