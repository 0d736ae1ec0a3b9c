"""The decoder, written once: one layer loop over a family's choice of blocks.

**Params** (the one form every family, loader and transform uses) are one
:class:`~functional_npu.core.params.Params` value: the tree of this rank's local shards, and as static fields the
model config (``params.config``) and the checked placement (``params.placement``, its plan among it)::

    Params(tree={"embed": [V/tp, D], "norm": [D], "lm_head": [V/tp, D] (untied only),
                 "layers": [{leaf: tensor, ...}, ...],   # one dict per layer; which leaves is the family's choice
                 "series": {leaf: ...},                  # layer-sharded leaves: this coordinate's, stacked
                 "host": {leaf: [L, ...]}},              # series kept in host memory, stacked
           config=<family config>, placement=<Placement>)

A layer-sharded leaf is absent from ``params["layers"]`` and lives in ``params["series"]`` (see
:mod:`functional_npu.parallel.layer_shard`); where each layer's weights come from, local or
prefetched from their owner ``k`` layers ahead, is :func:`functional_npu.parallel.prefetch.layer_weights`.

**State** is one :class:`DecodeState`: the KV cache, the carried prefetch ring and the ring's phase.

**The forward's contract** (:func:`forward`): ``logits [B, S, V]`` for ``tokens [B, S]`` at absolute
``positions [B, S]`` (a decode step is ``S == 1`` with each sequence's own position); with ``last [B]``, the index of
one of each row's tokens (a prefill's last prompt token), ``logits [B, 1, V]`` of those alone: the head, a
``D x V`` product per position, runs on one row per sequence instead of ``S``. The state is
donated and updated in place: each layer writes its keys and values into ``state.kv`` at
``positions``, ``state.prefetched``'s slots take the next step's first ``k`` layers' weights, and
``state.phase`` advances (the ring's list keeps its order: a graph per phase sees the same tensor at each slot).
Padded slots may hold garbage at positions a query never sees. A step's positions are consecutive per
sequence from its first, but for a right-padded prefill's pads: these take the position after the prompt's
last, which the first decode step overwrites (a sliding window's ring cache, :mod:`functional_npu.models.ring`,
keeps a step's latest positions). Every rank of a mesh axis that the
step communicates over (tp, expert axes, a layer-sharded series axis) must make the same calls.

**Blocks** (:class:`Blocks`): a family is a choice of blocks bound to its config and tensor-parallel
axis. Adding an attention or FFN kind is one new block function, not a copy of this loop. Each layer
adds ``attention(attn_norm(x))`` and then ``ffn(mlp_norm(x))`` to the residual stream; a layer that
holds ``post_attn_norm`` / ``post_mlp_norm`` (Gemma) norms each update before its add.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..core.mesh import Mesh
from ..parallel.plan import Plan
from ..parallel.prefetch import layer_weights
from ..parallel.prefetch_ring import Ring, RingPhase
from ..parallel.streams import INLINE, Streams
from .invariant_modes import ops as invariant_ops_of
from .norm import rms_norm

__all__ = ["Blocks", "DecodeState", "decode", "COMMON_LEAVES"]

# the leaves every family's params have and generic code may read: the ends and the two pre-norms of a layer
COMMON_LEAVES = ("embed", "norm", "lm_head", "attn_norm", "mlp_norm")

KV = tuple[torch.Tensor, torch.Tensor]


class DecodeState(NamedTuple):
    """Everything a step carries to the next: ``kv`` (per layer ``(k, v)``, written in place), ``prefetched`` (the
    prefetch ring, holding the first ``k`` layers' layer-sharded weights in flight; empty without prefetch) and
    ``phase``, the ring's phase (:class:`~functional_npu.parallel.prefetch_ring.RingPhase`: which slot holds which
    layer; advanced by each step, the ring's list never reordered)."""

    kv: list[KV]
    prefetched: list[torch.Tensor]
    phase: RingPhase


@dataclass(frozen=True)
class Blocks:
    """A family's blocks for one config, as the layer loop calls them.

    Attributes:
        embed: ``(params, tokens, mesh) -> x [B, S, D]``.
        prepare: ``(positions, kv of layer 0, dtype) -> step``: what every attention layer shares (with
            ``layer_types``: ``(positions, {layer type: kv of its first layer}, dtype) -> {layer type: step}``).
        attention: ``(layer, h, step, kv, mesh, kind) -> residual update``; writes ``kv`` in place.
        ffn: per layer, ``(layer, h, mesh) -> residual update`` (a dense MLP, an MoE, ...).
        head: ``(params, x, mesh) -> logits [B, S, V]``.
        argmax: ``(params, x, mesh) -> greedy tokens [B, S]``: the head reduced to its argmax where the
            logits live, so a vocab-parallel head moves (max, index) pairs, not logits.
        init_kv: ``(mesh, batch, max_seq_len, dtype, device) -> kv``: the attention kind's zeroed cache.
        eps: the pre-norms' epsilon (``attn_norm`` before attention, ``mlp_norm`` before the FFN; the post-norms'
            too).
        norm_offset: the norms' weight offset (:func:`~functional_npu.models.norm.rms_norm`'s; Gemma: 1).
        layer_types: per layer, the key of its step in what ``prepare`` returns (Gemma: ``"sliding_attention"``
            or ``"full_attention"``); empty: ``prepare`` returns the one step every layer shares.
    """

    embed: Callable[..., torch.Tensor]
    prepare: Callable[..., Any]
    attention: Callable[..., torch.Tensor]
    ffn: Sequence[Callable[..., torch.Tensor]]
    head: Callable[..., torch.Tensor]
    argmax: Callable[..., torch.Tensor]
    init_kv: Callable[..., list[KV]]
    eps: float
    norm_offset: float = 0.0
    layer_types: Sequence[str] = ()


def decode(
    params: dict,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    state: DecodeState,
    mesh: Mesh,
    last: torch.Tensor | None = None,
    *,
    blocks: Blocks,
    plan: Plan = Plan(),
    attention: str = "sdpa",
    streams: Streams = INLINE,
    greedy: bool = False,
    differentiable: bool = False,
    ring: Ring | None = None,
) -> torch.Tensor:
    """The forward through ``blocks`` (see the module docstring for the contract); ``streams`` are the
    compiler's ordering hints (:mod:`functional_npu.parallel.streams`); ``plan``: the one ``blocks`` were made for (its
    layer-sharded series' axis and prefetch step). ``greedy``: return the greedy
    tokens ``[B, S]`` (``blocks.argmax``) instead of the logits. ``differentiable``: layer-sharded weights
    arrive by differentiable broadcasts, not through the ring (``state.prefetched`` empty; see
    :func:`~functional_npu.parallel.prefetch.layer_weights`). ``ring``: the prefetch ring's layout the compiled model
    answered once (:func:`~functional_npu.parallel.prefetch_ring.ring_of`; None: answered from the params and
    ``plan``). ``last``: ``[B]`` indices into the step's tokens, one per row: the logits of those positions alone,
    ``[B, 1, V]``."""
    x = blocks.embed(params, tokens, mesh)  # [B, S, D]
    types = blocks.layer_types
    first = {t: state.kv[types.index(t)] for t in dict.fromkeys(types)} if types else state.kv[0]
    steps = blocks.prepare(positions, first, x.dtype)
    weights = layer_weights(
        params, state.prefetched, mesh, plan, streams, ring=ring, phase=state.phase, differentiable=differentiable
    )
    rms = invariant_ops_of(plan.invariant).rms_norm if plan.invariant else rms_norm
    norm = functools.partial(rms, eps=blocks.eps, offset=blocks.norm_offset)
    for i, kv in enumerate(state.kv):
        layer = weights(i, x)
        step = steps[blocks.layer_types[i]] if blocks.layer_types else steps
        y = blocks.attention(layer, norm(x, layer["attn_norm"]), step, kv, mesh, kind=attention)
        x = x + (norm(y, layer["post_attn_norm"]) if "post_attn_norm" in layer else y)
        y = blocks.ffn[i](layer, norm(x, layer["mlp_norm"]), mesh)
        x = x + (norm(y, layer["post_mlp_norm"]) if "post_mlp_norm" in layer else y)
    if last is not None:  # the rows the logits are wanted at, before the head's D x V product
        x = x.gather(1, last.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))
    return (blocks.argmax if greedy else blocks.head)(params, x, mesh)
