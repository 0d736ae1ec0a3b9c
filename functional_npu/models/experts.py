"""The mixture-of-experts feed-forward block: routing, experts stacked over slots, expert parallelism.

An MoE layer holds a router and experts stacked over ``S`` physical slots::

    {"router": [E, D], "experts_gate_up": [S, 2F, D], "experts_down": [S, D, F], "expert_map": int64 [E, C]}

``expert_map[e]`` lists the slots holding logical expert ``e`` (padded with -1); without redundant
experts ``S == E`` and the map is ``arange(E)[:, None]``. A token routed to ``e`` uses copy
``t % copies(e)`` where ``t`` is its index among the tokens this rank dispatches. The map is a
tensor input, so a rebalance changes values without recompiling (``S`` and ``C`` are static).

Experts are sharded on dim 0 over the plan's ``expert_axes`` (each rank holds ``S / ep`` consecutive slots).
If the tensor-parallel axis is not an expert axis, each expert is also tensor-parallel over it
(``[gate|up]`` column-parallel, ``down`` row-parallel + all_reduce). Tokens are exchanged over the
expert axes with static shapes and nothing is ever dropped: the sender routes and ``all_to_all``\\ s
its tokens and routing to every expert rank, results come back by the inverse ``all_to_all``; at or
below the plan's ``dispatch_threshold`` tokens per rank (decode) the tokens are ``all_gather``\\ ed instead, every
rank routes all of them and computes its slots' share, and ``reduce_scatter`` returns each rank's
sums. When the tp axis is an expert axis the tokens, identical on the tp ranks after attention, are
first split over it and gathered back after.

In the plan's ``invariant`` mode (:mod:`functional_npu.models.invariant`) every reduction is in one fixed order,
the same on either path: the router by an invariant linear, scores by the polynomial ``exp``, the renormalization
by a tree over the k; each token and chosen expert its own products with the expert's weight rows summed by a tree
over the input dim (never a batched matmul over the slots); the k weighted outputs kept apart, in float32, through
the exchange (a token's ``(t, k)`` entry is nonzero on one expert rank only, so the sums over the ranks add exact
zeros), then summed by a tree over the k; expert TP's sum by :func:`~functional_npu.models.invariant.tp_sum`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..core.collectives import all_gather, all_reduce, all_to_all_single, reduce_scatter
from ..core.layout import Block, Layout, Shard, fused, replicated, sharded
from ..core.mesh import Mesh
from ..parallel.plan import Plan
from . import invariant as inv
from .invariant_modes import ops as invariant_ops_of
from .linear import expert_weights, linear, quantized_activations, slot_count, token_amax
from .mlp import gated_mlp

__all__ = [
    "LEAVES",
    "Routing",
    "Experts",
    "expert_specs",
    "identity_map",
    "route",
    "local_experts",
    "moe_ffn",
]


# an MoE layer's leaves, whichever family holds it (the shared experts' when it has them)
LEAVES = (
    "router", "router_bias", "experts_gate_up", "experts_down", "expert_map", "shared_gate_up", "shared_down",
    "shared_gate",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Routing:
    """How router logits pick experts, beyond top-k and ``norm_topk_prob`` (transformers' semantics).

    Attributes:
        scoring: ``"softmax"`` over all experts, or ``"sigmoid"`` per expert (DeepSeek-V3).
        group_limit: ``"none"``; ``"max"`` (DeepSeek-V2's ``group_limited_greedy``: experts come from the
            ``topk_group`` groups with the best single score); ``"top2"`` (DeepSeek-V3's ``noaux_tc``: groups
            ranked by the sum of their best two bias-corrected scores).
        n_group, topk_group: experts split into ``n_group`` equal groups, ``topk_group`` of them eligible.
        scale: ``routed_scaling_factor``, on the final weights.
    """

    scoring: str = "softmax"
    group_limit: str = "none"
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0


class Experts(Protocol):
    """The config fields the experts block reads (any family with experts)."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    routing: Routing


def expert_specs(cfg: Experts, plan: Plan, shared: int = 0) -> dict[str, Layout]:
    """An MoE layer's plan: router and expert map replicated, slots over ``plan.expert_axes`` (each expert
    tensor-parallel over ``plan.tp`` too when it is not an expert axis); with ``shared`` (the shared experts'
    intermediate size) their gated MLP tensor-parallel like a dense one."""
    f, tp, axes = cfg.moe_intermediate_size, plan.tp, plan.expert_axes
    slot = Shard(axes) if axes else None
    inner = tp not in axes
    specs = {
        "router": replicated(),
        "experts_gate_up": Layout((slot, Shard((tp,), (Block("gate", f), Block("up", f))) if inner else None)),
        "experts_down": Layout((slot, None, Shard((tp,)) if inner else None)),
        "expert_map": replicated(),
    }
    if shared:
        specs |= {
            "shared_gate_up": fused(0, [Block("gate", shared), Block("up", shared)], tp),
            "shared_down": sharded(1, tp),
        }
    return specs


def identity_map(num_experts: int) -> torch.Tensor:
    """The expert map with no redundant experts: expert ``e`` in slot ``e``."""
    return torch.arange(num_experts)[:, None]


def route(
    logits: torch.Tensor, cfg: Experts, bias: torch.Tensor | None = None, invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, logical experts [T, k]) from router logits [T, E], by ``cfg.routing``.

    Scores (softmax or sigmoid, float32) plus ``bias`` (DeepSeek-V3's ``e_score_correction_bias``: it only
    chooses, the weights are the uncorrected scores); experts outside the chosen groups excluded; top-k;
    renormalized over the k when ``norm_topk_prob`` (Qwen3-MoE's flag; Mixtral always, which equals a
    softmax over the top-k logits); times ``routing.scale``. ``invariant``: the scores by
    :func:`~functional_npu.models.invariant.exp` and the sums by trees (:func:`_scores`).
    """
    routing = cfg.routing
    scores = _scores(logits, routing.scoring, invariant)
    choice = scores if bias is None else scores + bias.float()
    if routing.group_limit != "none" and routing.n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, routing.n_group, e // routing.n_group)
        if routing.group_limit == "top2":
            best = grouped.topk(2, dim=-1).values
            rank = best[..., 0] + best[..., 1] if invariant else best.sum(-1)
        else:
            rank = grouped.max(-1).values
        keep = torch.zeros_like(rank).scatter(1, rank.topk(routing.topk_group, dim=-1).indices, 1.0).bool()
        fill = float("-inf") if routing.group_limit == "top2" else 0.0
        choice = choice.masked_fill(~keep.repeat_interleave(e // routing.n_group, dim=1), fill)
    if bias is None:  # every kept choice is its score
        weights, experts = choice.topk(cfg.top_k, dim=-1)
    else:
        experts = choice.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
    if cfg.norm_topk_prob:
        weights = weights / (inv.tree_sum(weights, keepdim=True) if invariant else weights.sum(-1, keepdim=True))
    return weights * routing.scale if routing.scale != 1.0 else weights, experts


def _scores(logits: torch.Tensor, scoring: str, invariant: bool) -> torch.Tensor:
    """Float32 routing scores of ``logits [T, E]``: softmax over the experts or sigmoid per expert; ``invariant``:
    ``exp(x - max) / tree_sum(...)`` and ``1 / (1 + exp(-x))`` (:mod:`~functional_npu.models.invariant`)."""
    x = logits.float()
    if not invariant:
        return x.softmax(-1) if scoring == "softmax" else x.sigmoid()
    if scoring == "softmax":
        p = inv.exp(x - x.max(-1, keepdim=True).values)
        return p / inv.tree_sum(p, keepdim=True)
    return torch.ones_like(x) / (inv.exp(-x) + 1.0)


def _slots(
    x: torch.Tensor, layer: dict, cfg: Experts, index: torch.Tensor, invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, physical slots), both [T, k], for tokens ``x [T, D]`` with dispatch indices ``index [T]``."""
    logits = (invariant_ops_of(invariant).linear if invariant else linear)(x, layer["router"])
    weights, experts = route(logits, cfg, layer.get("router_bias"), invariant)
    table = layer["expert_map"]
    if table.shape[1] == 1:
        return weights, table[experts, 0]
    copies = (table >= 0).sum(-1)  # [E]
    return weights, table[experts, index[:, None] % copies[experts]]


def local_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: Any,
    down: Any,
    row_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``sum_k weights[:, k] * expert[ids[:, k]](x)`` over this rank's slots; ``ids`` -1 (another rank's slot)
    adds nothing.

    x: [N, D]; ids, weights: [N, k]; gate_up: [S_local, 2F, D]; down: [S_local, D, F] -> [N, D]. Static shapes
    either way (chosen by size): with fewer routed rows than local experts (decode) each row reads only its
    k experts' weights; otherwise every local expert runs on every row as one batched matmul, a row's
    weight being 0 for the slots it was not routed to. Neither graph grows with the expert count.
    Quantized experts (:func:`functional_npu.models.linear.prepare`) are dequantized as they are read;
    ``row_amax(h)``: W8A8 experts whose ``down`` is row-parallel, each row's magnitude over the whole row
    (reduced over tp), so the activations round as in the unsharded model.
    """
    n, k = ids.shape
    slots = slot_count(gate_up)
    xq = quantized_activations(x, gate_up)
    if n * k < slots:
        chosen = ids.clamp(min=0)  # a -1 reads slot 0 and is weighted 0
        w = torch.where(ids >= 0, weights, 0.0).to(x.dtype)  # [N, k]
        gate, up = torch.einsum("nd,nkfd->nkf", xq, expert_weights(gate_up, chosen)).chunk(2, dim=-1)  # [N, k, F]
        h = F.silu(gate) * up
        h = quantized_activations(h, down, row_amax(h) if row_amax else None)
        y = torch.einsum("nkf,nkdf->nkd", h, expert_weights(down, chosen))  # [N, k, D]
        return (y * w[..., None]).sum(1)
    index = torch.arange(slots, device=x.device)
    w = (weights[None] * (ids[None] == index[:, None, None])).sum(-1).to(x.dtype)  # [S_local, N]
    gate, up = torch.matmul(xq, expert_weights(gate_up).transpose(1, 2)).chunk(2, dim=-1)  # [S_local, N, F] each
    h = F.silu(gate) * up
    h = quantized_activations(h, down, row_amax(h) if row_amax else None)
    y = torch.matmul(h, expert_weights(down).transpose(1, 2))  # [S_local, N, D]
    return (y * w[..., None]).sum(0)


def _gathered(
    x: torch.Tensor, layer: dict, cfg: Experts, mesh: Mesh, axes: tuple[str, ...], row_amax=None, invariant=False
) -> torch.Tensor:
    """Small batches: all_gather the tokens, each rank computes its slots' share, reduce_scatter back."""
    t, n = x.shape[0], mesh.axis_size(axes)
    xa = all_gather(x, mesh, axes, dim=0)  # [n t, D]
    weights, slots = _slots(xa, layer, cfg, torch.arange(n * t, device=x.device) % t, invariant)
    per = slot_count(layer["experts_gate_up"])
    ids = torch.where(slots // per == mesh.axis_index(axes), slots % per, -1)
    if invariant:  # [n t, k, D]: each (token, k) nonzero on its expert's rank only, so the sum adds exact zeros
        part = invariant_ops_of(invariant).experts(xa, ids, weights, layer["experts_gate_up"], layer["experts_down"])
        return inv.tree_sum(reduce_scatter(part, mesh, axes, dim=0), dim=1).to(x.dtype)  # [t, D]
    part = local_experts(xa, ids, weights, layer["experts_gate_up"], layer["experts_down"], row_amax)
    return reduce_scatter(part, mesh, axes, dim=0)  # [t, D]


def _dispatched(
    x: torch.Tensor, layer: dict, cfg: Experts, mesh: Mesh, axes: tuple[str, ...], row_amax=None, invariant=False
) -> torch.Tensor:
    """Larger batches: route here, all_to_all tokens + routing to the expert ranks, inverse all_to_all back.

    Static shapes with no dropped token mean a capacity of all ``t`` tokens per destination, so the tokens
    move as many bytes as in :func:`_gathered`; this path routes each token once (by its sender) instead of
    on every rank, at the price of one more collective (the routing).
    """
    (t, d), k, n = x.shape, cfg.top_k, mesh.axis_size(axes)
    weights, slots = _slots(x, layer, cfg, torch.arange(t, device=x.device), invariant)
    per = slot_count(layer["experts_gate_up"])
    owner = torch.arange(n, device=x.device)[:, None, None]
    ids = torch.where(slots[None] // per == owner, slots[None] % per, -1)  # [n, t, k]: slot ids on rank j
    meta = torch.cat([ids.float(), weights[None].expand(n, t, k)], dim=-1)  # [n, t, 2k], ids exact in float32
    rx = all_to_all_single(x[None].expand(n, t, d).reshape(n * t, d), mesh, axes)  # [n t, D] by source
    rmeta = all_to_all_single(meta.reshape(n * t, 2 * k), mesh, axes)
    gate_up, down = layer["experts_gate_up"], layer["experts_down"]
    if invariant:  # [n t, k, D] back: each (token, k) nonzero from its expert's rank only
        mine = invariant_ops_of(invariant).experts(rx, rmeta[:, :k].long(), rmeta[:, k:], gate_up, down)
        back = all_to_all_single(mine, mesh, axes)
        return inv.tree_sum(inv.tree_sum(back.view(n, t, k, d), dim=0), dim=1).to(x.dtype)
    part = local_experts(rx, rmeta[:, :k].long(), rmeta[:, k:], gate_up, down, row_amax)
    back = all_to_all_single(part, mesh, axes)  # [n t, D]: each expert rank's share of my tokens
    return back.view(n, t, d).sum(0)


def _exchange(x: torch.Tensor, layer: dict, cfg: Experts, mesh: Mesh, plan: Plan, row_amax=None) -> torch.Tensor:
    """The experts' output for tokens ``x [T, D]``: local, or exchanged over the expert axes by batch size."""
    axes, invariant = plan.expert_axes, plan.invariant
    if not axes or mesh.axis_size(axes) == 1:
        weights, slots = _slots(x, layer, cfg, torch.arange(x.shape[0], device=x.device), invariant)
        gate_up, down = layer["experts_gate_up"], layer["experts_down"]
        if invariant:
            routed = invariant_ops_of(invariant).experts(x, slots, weights, gate_up, down)  # [T, k, D]
            return inv.tree_sum(routed, dim=1).to(x.dtype)
        return local_experts(x, slots, weights, gate_up, down, row_amax)
    if x.shape[0] <= plan.dispatch_threshold:
        return _gathered(x, layer, cfg, mesh, axes, row_amax, invariant)
    return _dispatched(x, layer, cfg, mesh, axes, row_amax, invariant)


def moe_ffn(layer: dict, h: torch.Tensor, mesh: Mesh, *, cfg: Experts, plan: Plan) -> torch.Tensor:
    """``h [B, S, D]`` (normed) -> the residual update ``[B, S, D]``, replicated over ``plan.tp`` like a dense
    MLP's; the tokens exchanged over ``plan.expert_axes`` (``plan.dispatch_threshold`` picks the path).

    With shared experts (``shared_gate_up`` / ``shared_down``: a dense gated MLP every token runs, tensor-parallel
    over ``tp``), their output is added, scaled by ``sigmoid(h @ shared_gate.T)`` when the layer has a
    ``shared_gate [1, D]`` (Qwen2-MoE)."""
    routed = _routed(layer, h, mesh, cfg=cfg, plan=plan)
    if "shared_gate_up" not in layer:
        return routed
    shared_mlp = {"gate_up": layer["shared_gate_up"], "down": layer["shared_down"]}
    shared = gated_mlp(shared_mlp, h, mesh, tp=plan.tp, invariant=plan.invariant)
    if "shared_gate" in layer:
        if plan.invariant:
            gate = _scores(invariant_ops_of(plan.invariant).linear(h, layer["shared_gate"]), "sigmoid", True)
            gate = gate.to(h.dtype)
        else:
            gate = torch.sigmoid(linear(h, layer["shared_gate"]))
        shared = shared * gate
    return routed + shared


def _routed(layer: dict, h: torch.Tensor, mesh: Mesh, *, cfg: Experts, plan: Plan) -> torch.Tensor:
    """The routed experts' share of :func:`moe_ffn`."""
    b, s, d = h.shape
    x, tp = h.reshape(b * s, d), plan.tp
    expert_tp = tp not in plan.expert_axes
    split = not expert_tp and mesh.axis_size(tp) > 1
    if split:  # tokens are identical on the tp ranks: each dispatches its own 1/tp of them
        size, total = mesh.axis_size(tp), x.shape[0]
        per = -(-total // size)
        x = F.pad(x, (0, 0, 0, per * size - total)).narrow(0, mesh.axis_index(tp) * per, per)
    row_amax = None
    down = layer["experts_down"]
    if expert_tp and mesh.axis_size(tp) > 1 and isinstance(down, dict) and "q8a8" in down:
        # W8A8 experts: down is row-parallel over tp, so a row's int8 scale is reduced over tp
        def row_amax(h: torch.Tensor) -> torch.Tensor:
            return all_reduce(token_amax(h), mesh, tp, op="max")

    y = _exchange(x, layer, cfg, mesh, plan, row_amax)
    if split:
        y = all_gather(y, mesh, tp, dim=0)[:total]
    if expert_tp:  # each expert's down projection is row-parallel
        y = inv.tp_sum(y, mesh, tp) if plan.invariant else all_reduce(y, mesh, tp)
    return y.view(b, s, d)
