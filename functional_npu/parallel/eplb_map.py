"""EPLB: redundant-expert placement maps, the routing table they imply, and rebalancing moves.

A *placement* is an int tensor ``[layers, ranks, slots]``: ``placement[l, r, p]`` is the logical
expert held in slot ``p`` of rank ``r`` (index along the expert axis) in MoE layer ``l``. Slot
``p`` of rank ``r`` is physical slot ``r * slots + p``, i.e. row ``p`` of that rank's
``experts_gate_up`` / ``experts_down`` (``[slots, ...]``, dim 0 sharded over the expert axis). A
hot expert may sit in several slots (redundant copies); every expert sits in at least one.

* :func:`validate_placement` checks a map (shape, ids in range, equal slot counts, every expert
  placed) and returns it as an int64 tensor.
* :func:`routing_table` turns a map into each layer's ``expert_map`` ``[E, C]``: the physical
  slots of every logical expert, ascending, padded with -1. The forward sends a token ``t``
  routed to expert ``e`` to slot ``expert_map[e, t % copies(e)]``.
* :func:`plan_rebalance` lists the point-to-point moves from an old map to a new one: only the
  experts a rank needs and does not already hold travel (once per rank and layer); a rank that
  holds the expert in another slot copies it locally. Pure; the same plan on every rank.
* :func:`rebalance` executes a plan on a params tree with one uneven ``all_to_all_single`` per
  expert leaf kind over the expert axis; traceable with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core import collectives
from ..core.mesh import Axes, Mesh
from ..core.params import Params
from ..core.shard import as_bits
from ..core.tree import PyTree

__all__ = [
    "Move",
    "RebalancePlan",
    "RankProgram",
    "validate_placement",
    "default_placement",
    "routing_table",
    "plan_rebalance",
    "rank_program",
    "rebalance",
    "EXPERT_LEAVES",
]

# The stacked expert leaves of an MoE layer, [gate|up] then down (dim 0: slots). The one definition:
# the model families, ep_tp and the rebalance here all take the names from it.
EXPERT_LEAVES = ("experts_gate_up", "experts_down")

Placement = tuple[tuple[tuple[int, ...], ...], ...]  # [layers][ranks][slots] -> expert id


# ---- placement maps -------------------------------------------------------------------------
def _as_nested(placement: object, what: str) -> list[list[list[int]]]:
    if isinstance(placement, torch.Tensor):
        if placement.dtype.is_floating_point or placement.dtype.is_complex or placement.dtype == torch.bool:
            raise TypeError(
                f"{what} has dtype {placement.dtype}; expected an integer tensor of expert ids [layers, ranks, slots]"
            )
        if placement.ndim != 3:
            raise ValueError(
                f"{what} has shape {tuple(placement.shape)}; "
                f"expected 3 dims [layers, ranks, slots] (add a layer dim with placement[None])"
            )
        return placement.tolist()
    if (
        isinstance(placement, str)
        or not isinstance(placement, Sequence)
        or not all(isinstance(layer, Sequence) for layer in placement)
    ):
        raise TypeError(
            f"{what} is a {type(placement).__name__}; expected an int "
            f"tensor or nested lists [layers][ranks][slots] of expert ids"
        )
    out = []
    for li, layer in enumerate(placement):
        ranks = []
        for r, slots in enumerate(layer):
            if not isinstance(slots, Sequence) or not all(
                isinstance(e, int) and not isinstance(e, bool) for e in slots
            ):
                raise TypeError(f"{what}[{li}][{r}] is {slots!r}; expected a list of int expert ids (one per slot)")
            ranks.append(list(slots))
        out.append(ranks)
    return out


def validate_placement(
    placement: torch.Tensor | Sequence[Sequence[Sequence[int]]],
    num_experts: int,
    *,
    num_ranks: int | None = None,
    what: str = "placement",
) -> torch.Tensor:
    """Check a placement map and return it as an int64 tensor ``[layers, ranks, slots]``.

    Args:
        placement: int tensor or nested lists ``[layers][ranks][slots]`` of logical expert ids.
        num_experts: E; every id must be in ``[0, E)`` and every expert placed at least once per layer.
        num_ranks: if given, the size of the expert axis the map must have.
        what: the name used in error messages.

    Raises:
        TypeError / ValueError naming the layer, rank, slot, sizes and a fix.

    Example:
        >>> validate_placement([[[0, 1], [2, 0]]], 3).shape
        torch.Size([1, 2, 2])
    """
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    nested = _as_nested(placement, what)
    _check_sizes(nested, num_experts, num_ranks, what)
    _check_experts(nested, num_experts, what)
    return torch.tensor(nested, dtype=torch.int64)


def _check_sizes(nested: list[list[list[int]]], num_experts: int, num_ranks: int | None, what: str) -> None:
    """Every layer spans the same ranks, every rank has the same slots, and they are enough for the experts."""
    if not nested or not nested[0]:
        raise ValueError(f"{what} is empty; expected [layers, ranks, slots] with at least one layer and rank")
    ranks, slots = len(nested[0]), len(nested[0][0])
    for li, layer in enumerate(nested):
        if len(layer) != ranks:
            raise ValueError(
                f"{what} layer {li} has {len(layer)} ranks but layer 0 has {ranks}; "
                f"every layer spans the same expert axis"
            )
        for r, row in enumerate(layer):
            if len(row) != slots:
                raise ValueError(
                    f"{what} layer {li} rank {r} has {len(row)} slots but rank 0 of layer 0 has {slots}; every rank "
                    f"needs the same number of slots (pad the short ranks with redundant copies of hot experts)"
                )
    if slots == 0:
        raise ValueError(f"{what} has 0 slots per rank; each rank needs at least one slot")
    if num_ranks is not None and ranks != num_ranks:
        raise ValueError(
            f"{what} spans {ranks} ranks but the expert axis has size {num_ranks}; build the map for {num_ranks} ranks"
        )
    if ranks * slots < num_experts:
        raise ValueError(
            f"{what} has {ranks} ranks x {slots} slots = {ranks * slots} slots for "
            f"{num_experts} experts; use at least {-(-num_experts // ranks)} slots per rank"
        )


def _check_experts(nested: list[list[list[int]]], num_experts: int, what: str) -> None:
    """Every id is an expert, and every expert has a slot in every layer."""
    for li, layer in enumerate(nested):
        for r, row in enumerate(layer):
            for p, e in enumerate(row):
                if not 0 <= e < num_experts:
                    raise ValueError(
                        f"{what}[{li}, {r}, {p}] = {e} is not an expert id in [0, {num_experts}); "
                        f"fix the map or num_experts"
                    )
        missing = sorted(set(range(num_experts)) - {e for row in layer for e in row})
        if missing:
            raise ValueError(
                f"{what} layer {li} places no copy of experts {missing[:16]}{' ...' if len(missing) > 16 else ''}; "
                f"every expert needs at least one slot (replace a redundant copy with it)"
            )


def default_placement(num_layers: int, num_experts: int, num_ranks: int) -> torch.Tensor:
    """The map without redundancy: rank ``r`` holds experts ``[r * E/n, (r+1) * E/n)`` in every layer.

    Example:
        >>> default_placement(1, 4, 2).tolist()
        [[[0, 1], [2, 3]]]
    """
    counts = {"num_layers": num_layers, "num_experts": num_experts, "num_ranks": num_ranks}
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"default_placement: {name} must be a positive int, got {value!r}")
    if num_experts % num_ranks:
        raise ValueError(
            f"{num_experts} experts cannot be split evenly over an expert "
            f"axis of size {num_ranks}; use a size that divides {num_experts}"
        )
    return torch.arange(num_experts).reshape(1, num_ranks, -1).repeat(num_layers, 1, 1)


def routing_table(placement: torch.Tensor, num_experts: int, *, copies: int | None = None) -> torch.Tensor:
    """Each layer's ``expert_map``: int64 ``[layers, E, C]``, the physical slots of every expert, -1 padded.

    Args:
        placement: a map ``[layers, ranks, slots]`` (validated here).
        num_experts: E.
        copies: C, the padded width; default the most copies any expert has in any layer. Give the
            width the compiled forward was built with so a new map changes values, not shapes.

    Example:
        >>> routing_table(torch.tensor([[[0, 1], [2, 0]]]), 3)[0].tolist()
        [[0, 3], [1, -1], [2, -1]]
    """
    p = validate_placement(placement, num_experts)
    return torch.tensor(_pad_routes(_routes(_to_tuples(p), num_experts), copies), dtype=torch.int64)


Routes = tuple[tuple[tuple[int, ...], ...], ...]  # [layers][experts] -> physical slots, ascending


def _routes(placement: Placement, num_experts: int) -> Routes:
    out = []
    for layer in placement:
        flat = [e for row in layer for e in row]
        out.append(tuple(tuple(s for s, x in enumerate(flat) if x == e) for e in range(num_experts)))
    return tuple(out)


def _pad_routes(routes: Routes, copies: int | None, what: str = "routing_table") -> list[list[list[int]]]:
    """The routes as a -1 padded ``[layers, E, C]`` nested list (list-only code: it runs under tracing too)."""
    most, li, e = max([(len(row), li, e) for li, layer in enumerate(routes) for e, row in enumerate(layer)])
    width = most if copies is None else copies
    if width < most:
        raise ValueError(
            f"{what}: expert {e} has {most} copies in layer {li} but copies={copies}; raise copies to {most} "
            f"(a new width recompiles the forward) or place fewer copies"
        )
    return [[list(row) + [-1] * (width - len(row)) for row in layer] for layer in routes]


# ---- planning -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Move:
    """One expert sent point to point: layer, expert, from (rank, slot) of the old map to ``dst_rank``."""

    layer: int
    expert: int
    src_rank: int
    src_slot: int
    dst_rank: int


@dataclass(frozen=True, slots=True)
class RankProgram:
    """What one rank does for a plan, for every expert leaf.

    Attributes:
        send: per destination index, the ``(layer, old slot)`` rows sent there, in order.
        recv_counts: per source index, how many rows arrive from it.
        take: per layer, for each new slot, its row in ``cat([old rows of that layer, received rows])``.
    """

    send: tuple[tuple[tuple[int, int], ...], ...]
    recv_counts: tuple[int, ...]
    take: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class RebalancePlan:
    """The moves from ``old`` to ``new`` (both ``[layers][ranks][slots]`` tuples), the same on every rank.

    Attributes:
        moves: every expert sent between ranks, ordered by layer, destination, slot.
        programs: per index along the expert axis, what that rank sends, receives and assembles.
        routes: per layer and logical expert, the physical slots of the new map (for ``expert_map``).
    """

    old: Placement
    new: Placement
    num_experts: int
    moves: tuple[Move, ...]
    programs: tuple[RankProgram, ...]
    routes: Routes

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.old), len(self.old[0]), len(self.old[0][0]))

    def experts_moved(self) -> int:
        """How many (layer, expert) copies cross ranks."""
        return len(self.moves)

    def bytes_moved(self, bytes_per_expert: int) -> int:
        """Bytes sent between ranks, for experts of ``bytes_per_expert`` (gate_up + down) each."""
        return len(self.moves) * bytes_per_expert


def _to_tuples(p: torch.Tensor) -> Placement:
    return tuple(tuple(tuple(row) for row in layer) for layer in p.tolist())


def plan_rebalance(old: torch.Tensor | Sequence, new: torch.Tensor | Sequence, num_experts: int) -> RebalancePlan:
    """The point-to-point moves that turn the ``old`` placement into ``new``. Pure.

    A rank receives each expert it needs and does not hold once per layer (the lower bound on
    bytes moved); a second slot with the same expert, or an expert already held in another slot,
    is a local copy. The source is the holder with the fewest sends so far in that layer (ties:
    the nearest rank after the destination), so copies of hot experts share the sending.

    Example:
        >>> plan_rebalance([[[0, 1], [2, 0]]], [[[0, 1], [2, 1]]], 3).moves  # rank 1 trades its copy of 0 for one of 1
        (Move(layer=0, expert=1, src_rank=0, src_slot=1, dst_rank=1),)
    """
    o = validate_placement(old, num_experts, what="old placement")
    n = validate_placement(new, num_experts, what="new placement")
    if o.shape != n.shape:
        raise ValueError(
            f"old placement has shape {tuple(o.shape)} and new {tuple(n.shape)} [layers, ranks, slots]; "
            f"a rebalance keeps layers, ranks and slots per rank"
        )
    old_t, new_t = _to_tuples(o), _to_tuples(n)
    moves = []
    ranks = len(old_t[0])
    for li, (old_layer, new_layer) in enumerate(zip(old_t, new_t)):
        sends = [0] * ranks
        for r in range(ranks):
            for e in dict.fromkeys(new_layer[r]):  # distinct, in slot order
                if e in old_layer[r]:
                    continue
                src = min((j for j in range(ranks) if e in old_layer[j]), key=lambda j: (sends[j], (j - r) % ranks))
                sends[src] += 1
                moves.append(Move(li, e, src, old_layer[src].index(e), r))
    programs = tuple(_program(old_t, new_t, moves, r) for r in range(ranks))
    return RebalancePlan(old_t, new_t, num_experts, tuple(moves), programs, _routes(new_t, num_experts))


def rank_program(plan: RebalancePlan, rank: int) -> RankProgram:
    """The sends, receives and local assembly of index ``rank`` along the expert axis (planned with the moves)."""
    if not isinstance(plan, RebalancePlan):
        raise TypeError(f"rank_program: plan must be a RebalancePlan (plan_rebalance(old, new)), got {plan!r:.60}")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"rank_program: rank must be an int index along the expert axis, got {rank!r}")
    if not 0 <= rank < len(plan.programs):
        raise ValueError(f"rank_program: rank {rank} is outside the expert axis of size {len(plan.programs)}")
    return plan.programs[rank]


def _program(old: Placement, new: Placement, moves: list[Move], rank: int) -> RankProgram:
    ranks, slots = len(old[0]), len(old[0][0])
    send = tuple(
        tuple((m.layer, m.src_slot) for m in moves if m.src_rank == rank and m.dst_rank == j) for j in range(ranks)
    )
    incoming = [m for j in range(ranks) for m in moves if m.src_rank == j and m.dst_rank == rank]  # arrival order
    arrived = {(m.layer, m.expert): slots + i for i, m in enumerate(incoming)}
    take = []
    for li in range(len(old)):
        old_row = old[li][rank]
        take.append(tuple(old_row.index(e) if e in old_row else arrived[(li, e)] for e in new[li][rank]))
    recv_counts = tuple(sum(1 for m in incoming if m.src_rank == j) for j in range(ranks))
    return RankProgram(send, recv_counts, tuple(take))


# ---- execution ------------------------------------------------------------------------------
def _moe_layers(params: PyTree) -> list[tuple[int, dict[str, Any]]]:
    """(index in params["layers"], layer dict) of every MoE layer, in order."""
    layers = params.get("layers") if isinstance(params, (dict, Params)) else None
    if not isinstance(layers, (list, tuple)):
        raise TypeError(
            "rebalance: params must be a dict with a 'layers' list of per-layer dicts (the models/ params tree)"
        )
    return [(i, layer) for i, layer in enumerate(layers) if isinstance(layer, dict) and EXPERT_LEAVES[0] in layer]


def _check_params(moe: list[tuple[int, dict[str, Any]]], plan: RebalancePlan, mesh: Mesh, axis: Axes) -> None:
    layers, ranks, slots = plan.shape
    if mesh.axis_size(axis) != ranks:
        raise ValueError(
            f"rebalance: the plan spans {ranks} ranks but mesh axis {axis!r} has size "
            f"{mesh.axis_size(axis)}; plan for the expert axis the params are sharded over"
        )
    if len(moe) != layers:
        raise ValueError(
            f"rebalance: params have {len(moe)} MoE layers (with 'experts_gate_up') "
            f"but the plan has {layers}; give one placement layer per MoE layer"
        )
    for i, layer in moe:
        for name in EXPERT_LEAVES:
            path = f"layers.{i}.{name}"
            x = layer.get(name)
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"params[{path!r}] is {type(x).__name__}; expected the stacked expert tensor [slots, ...]"
                )
            if x.ndim < 1 or x.shape[0] != slots:
                raise ValueError(
                    f"params[{path!r}] has local shape {tuple(x.shape)}, {x.shape[0] if x.ndim else 0} "
                    f"slots on this rank, but the placement has {slots} slots per rank over mesh axis "
                    f"{axis!r} (size {ranks}); pass this rank's shard (dim 0 sharded over {axis!r})"
                )
        if "expert_map" in layer and layer["expert_map"].shape[0] != plan.num_experts:
            raise ValueError(
                f"params['layers.{i}.expert_map'] has {layer['expert_map'].shape[0]} "
                f"experts but the plan has {plan.num_experts}"
            )


def _send_rows(xs: list[torch.Tensor], prog: RankProgram) -> torch.Tensor:
    """The rows this rank sends, grouped by destination index (the all_to_all input)."""
    rows = [xs[li][s] for dst in prog.send for (li, s) in dst]
    return torch.stack(rows) if rows else xs[0].new_empty((0, *xs[0].shape[1:]))


def _assemble(xs: list[torch.Tensor], recv: torch.Tensor, prog: RankProgram) -> list[torch.Tensor]:
    """Every layer's new ``[slots, ...]`` rows from its old rows and the received ones."""
    new = []
    for x, take in zip(xs, prog.take):
        pool = torch.cat([x, recv]) if recv.shape[0] else x
        new.append(pool.index_select(0, torch.tensor(take, dtype=torch.long, device=x.device)))
    return new


def _move(xs: list[torch.Tensor], prog: RankProgram, mesh: Mesh, axis: Axes, exchange: bool) -> list[torch.Tensor]:
    """New local tensors for every layer of one expert leaf: one uneven all_to_all, then local gathers."""
    send = _send_rows(xs, prog)
    recv = send[:0]
    if exchange:
        out = collectives.all_to_all_single(as_bits(send), mesh, axis, prog.recv_counts, [len(d) for d in prog.send])
        recv = out.view(send.dtype)
    return _assemble(xs, recv, prog)


def rebalance(params: PyTree, plan: RebalancePlan, mesh: Mesh, axis: Axes, *, copies: int | None = None) -> PyTree:
    """Move this rank's experts from ``plan.old`` to ``plan.new``; return the new params tree.

    Collective over ``axis`` (every rank calls it with the same plan). Each MoE layer (a layer dict
    with ``experts_gate_up``) is given the new ``experts_gate_up`` / ``experts_down`` rows and, if
    it has one, a new ``expert_map`` from :func:`routing_table` (same width C unless ``copies``
    says otherwise). Other leaves are passed through as they are; inputs are never modified.
    Everything is validated before any byte is sent.

    Args:
        params: ``{"layers": [layer dict, ...], ...}`` of local shards; the MoE layers, in order,
            are the plan's layers.
        plan: from :func:`plan_rebalance`.
        mesh: a mesh with a coordinate; ``axis`` the expert axis (or axes, in mesh order).
        copies: the width of the new ``expert_map`` (default: the old map's width).

    Returns:
        A new params dict (new ``layers`` list and MoE layer dicts).

    Example:
        >>> plan = plan_rebalance(old, new, num_experts=64)            # doctest: +SKIP
        >>> params = rebalance(params, plan, mesh, ("dp", "tp"))       # doctest: +SKIP
    """
    if not isinstance(plan, RebalancePlan):
        raise TypeError(
            f"rebalance: plan is a {type(plan).__name__}; build it with plan_rebalance(old, new, num_experts)"
        )
    moe = _moe_layers(params)
    _check_params(moe, plan, mesh, axis)
    maps = {i: layer["expert_map"] for i, layer in moe if "expert_map" in layer}
    tables = None
    if maps:
        width = copies if copies is not None else max([m.shape[1] for m in maps.values()])
        tables = _pad_routes(
            plan.routes, width, "rebalance (the new expert_map keeps the old width unless copies= is given)"
        )
    prog = plan.programs[mesh.axis_index(axis)]
    moved = {
        name: _move([layer[name] for _, layer in moe], prog, mesh, axis, bool(plan.moves)) for name in EXPERT_LEAVES
    }
    new_layers = list(params["layers"])
    for k, (i, layer) in enumerate(moe):  # k: the k-th MoE layer, i: its index in params["layers"]
        new_layers[i] = dict(layer) | {name: moved[name][k] for name in EXPERT_LEAVES}
        if tables is not None and i in maps:
            new_layers[i]["expert_map"] = torch.tensor(tables[k], dtype=torch.int64, device=maps[i].device)
    return params | {"layers": new_layers}
