"""Mixture-of-experts families as pure functions: Qwen3-MoE and Mixtral, with expert parallelism.

Attention, embeddings, norms and rope are the Llama family's (``models/llama.py``); an MoE layer
replaces the dense MLP with a router and experts stacked over ``S`` physical slots::

    {"router": [E, D], "experts_gate_up": [S, 2F, D], "experts_down": [S, D, F],
     "expert_map": int64 [E, C]}

``expert_map[e]`` lists the slots holding logical expert ``e`` (padded with -1); without redundant
experts ``S == E`` and the map is ``arange(E)[:, None]``. A token routed to ``e`` uses copy
``t % copies(e)`` where ``t`` is its index among the tokens this rank dispatches. The map is a
tensor input, so a rebalance changes values without recompiling (``S`` and ``C`` are static).

Parallel plan (``MoeConfig.expert_axes``): experts are sharded on dim 0 over the expert axes
(e.g. ``("dp", "tp")``: each rank holds ``S / ep`` consecutive slots, slot ``s`` lives at index
``s // (S / ep)`` of the flattened axes). If ``"tp"`` is not an expert axis, each expert is also
tensor-parallel over ``tp`` (``[gate|up]`` column-parallel, ``down`` row-parallel + all_reduce).
Tokens are exchanged over the expert axes with static shapes and nothing is ever dropped: the
sender routes and ``all_to_all``\\ s its tokens and routing to every expert rank, results come back
by the inverse ``all_to_all``; at or below ``dispatch_threshold`` tokens per rank (decode) the
tokens are ``all_gather``\\ ed instead, every rank routes all of them and computes its slots'
share, and ``reduce_scatter`` returns each rank's sums. When ``tp`` is an expert axis the tokens,
identical on the tp ranks after attention, are first split over ``tp`` and gathered back after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..core.collectives import all_gather, all_reduce, all_to_all_single, reduce_scatter
from ..core.layout import Block, Layout, Shard, replicated
from ..core.mesh import Mesh
from ..core.tree import map_with_path, register_static
from . import llama

__all__ = ["MoeConfig", "ARCHITECTURES", "hf_names", "abstract_params", "init_params", "param_specs", "forward", "init_cache", "route", "EXPERT_LEAVES"]

# architecture -> (the dense sibling whose attention it shares, HF model_type)
_SIBLING = {"Qwen3MoeForCausalLM": ("Qwen3ForCausalLM", "qwen3_moe"), "MixtralForCausalLM": ("MistralForCausalLM", "mixtral")}
ARCHITECTURES = tuple(_SIBLING)
EXPERT_LEAVES = frozenset({"experts_gate_up", "experts_down"})  # stacked over slots; HF stores one tensor per expert {j}

_EXPERT_NAMES = {
    "Qwen3MoeForCausalLM": {
        "router": ["model.layers.{i}.mlp.gate.weight"],
        "experts_gate_up": ["model.layers.{i}.mlp.experts.{j}.gate_proj.weight", "model.layers.{i}.mlp.experts.{j}.up_proj.weight"],
        "experts_down": ["model.layers.{i}.mlp.experts.{j}.down_proj.weight"],
    },
    "MixtralForCausalLM": {
        "router": ["model.layers.{i}.block_sparse_moe.gate.weight"],
        "experts_gate_up": ["model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", "model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight"],
        "experts_down": ["model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight"],
    },
}


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeConfig:
    """Static config of an MoE model plus its expert-parallel plan.

    Attributes:
        architecture: "Qwen3MoeForCausalLM" or "MixtralForCausalLM".
        base: the attention / embedding / dense-MLP config (a :class:`LlamaConfig` of the dense sibling).
        num_experts: logical experts ``E``; top_k: experts per token.
        moe_intermediate_size: each expert's ``F``.
        norm_topk_prob: renormalize the top-k probabilities (always for Mixtral).
        moe_layers: indices of the MoE layers (the others have a dense MLP of ``base.intermediate_size``).
        num_slots: physical expert slots ``S`` (``E`` plus redundant copies; None: ``E``).
        max_copies: ``C``, the width of ``expert_map``.
        expert_axes: mesh axes the slots are sharded over (() : experts on every rank).
        dispatch_threshold: tokens per rank at or below which the gather / reduce-scatter path is used.
    """

    architecture: str
    base: llama.LlamaConfig
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]
    num_slots: int | None = None
    max_copies: int = 1
    expert_axes: tuple[str, ...] = ()
    dispatch_threshold: int = 8

    # fields generic code reads from any family's config
    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def num_layers(self) -> int:
        return self.base.num_layers

    @property
    def tie_word_embeddings(self) -> bool:
        return self.base.tie_word_embeddings

    @property
    def max_position_embeddings(self) -> int:
        return self.base.max_position_embeddings

    @property
    def slots(self) -> int:
        return self.num_slots or self.num_experts

    @property
    def expert_tp(self) -> bool:
        """Whether each expert is tensor-parallel over ``tp`` (when ``tp`` is not an expert axis)."""
        return "tp" not in self.expert_axes

    @staticmethod
    def from_hf(hf: Mapping[str, Any]) -> MoeConfig:
        """Build from a parsed HF ``config.json`` (``Qwen3MoeForCausalLM`` or ``MixtralForCausalLM``)."""
        arch = (hf.get("architectures") or [None])[0]
        if arch not in _SIBLING:
            raise ValueError(f"unsupported architecture {arch!r}; supported MoE architectures: {', '.join(ARCHITECTURES)}")
        base = llama.LlamaConfig.from_hf({**hf, "architectures": [_SIBLING[arch][0]]})
        experts = hf.get("num_experts") or hf.get("num_local_experts")
        top_k = hf.get("num_experts_per_tok")
        if not isinstance(experts, int) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
            raise ValueError(f"config.json: need int num_experts (or num_local_experts) >= num_experts_per_tok >= 1, got {experts!r} and {top_k!r}")
        if hf.get("shared_expert_intermediate_size"):
            raise ValueError("config.json: shared experts are not supported by this family")
        if arch == "MixtralForCausalLM":
            return MoeConfig(architecture=arch, base=base, num_experts=experts, top_k=top_k, moe_intermediate_size=base.intermediate_size,
                             norm_topk_prob=True, moe_layers=tuple(range(base.num_layers)))
        step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(base.num_layers) if i not in dense and (i + 1) % step == 0)
        return MoeConfig(architecture=arch, base=base, num_experts=experts, top_k=top_k, moe_intermediate_size=int(hf["moe_intermediate_size"]),
                         norm_topk_prob=bool(hf.get("norm_topk_prob", False)), moe_layers=layers)

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (read back by :meth:`from_hf`; the plan fields are not part of it)."""
        out = self.base.to_hf() | {"architectures": [self.architecture], "model_type": _SIBLING[self.architecture][1], "num_experts_per_tok": self.top_k}
        if self.architecture == "MixtralForCausalLM":
            return out | {"num_local_experts": self.num_experts}
        dense = [i for i in range(self.num_layers) if i not in self.moe_layers]
        return out | {"num_experts": self.num_experts, "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                      "decoder_sparse_step": 1, "mlp_only_layers": dense}


register_static(MoeConfig)


def hf_names(cfg: MoeConfig) -> dict[str, list[str]]:
    """HF tensor names of each param leaf in block order (``{i}``: layer, ``{j}``: expert); expert_map is computed."""
    return {**llama.HF_NAMES, **_EXPERT_NAMES[cfg.architecture], "expert_map": []}


# ---- the parallel plan ------------------------------------------------------------------------
def _moe_shapes(cfg: MoeConfig) -> dict[str, tuple[int, ...]]:
    d, f, s = cfg.base.hidden_size, cfg.moe_intermediate_size, cfg.slots
    return {"router": (cfg.num_experts, d), "experts_gate_up": (s, 2 * f, d), "experts_down": (s, d, f)}


def abstract_params(cfg: MoeConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "meta") -> dict[str, Any]:
    """The full (unsharded) params tree with empty tensors (on the meta device by default)."""
    dense = llama.abstract_params(cfg.base, dtype, device)
    layers = []
    for i, layer in enumerate(dense["layers"]):
        if i in cfg.moe_layers:
            layer = {k: v for k, v in layer.items() if k not in ("gate_up", "down")}
            layer |= {k: torch.empty(v, dtype=dtype, device=device) for k, v in _moe_shapes(cfg).items()}
            layer["expert_map"] = torch.empty((cfg.num_experts, cfg.max_copies), dtype=torch.int64, device=device)
        layers.append(layer)
    return dense | {"config": cfg, "layers": layers}


def identity_map(num_experts: int) -> torch.Tensor:
    """The expert map with no redundant experts: expert ``e`` in slot ``e``."""
    return torch.arange(num_experts)[:, None]


def init_params(cfg: MoeConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Full params with seeded random weights (std 0.02, norms 1) and the identity expert map."""
    if cfg.slots != cfg.num_experts or cfg.max_copies != 1:
        raise ValueError(f"init_params: makes the identity placement (num_slots={cfg.num_experts}, max_copies=1), got {cfg.slots} and {cfg.max_copies}")
    g = torch.Generator().manual_seed(seed)

    def fill(path: str, x: torch.Tensor) -> torch.Tensor:
        if path.endswith("expert_map"):
            return identity_map(cfg.num_experts)
        if path.endswith("norm"):
            return torch.ones(x.shape, dtype=dtype)
        return (torch.randn(x.shape, generator=g) * 0.02).to(dtype)

    return map_with_path(fill, abstract_params(cfg))


def param_specs(cfg: MoeConfig) -> dict[str, Any]:
    """The plan: attention and dense MLPs as in ``llama.param_specs``; experts over ``expert_axes`` (and ``tp`` inside)."""
    dense = llama.param_specs(cfg.base)
    f = cfg.moe_intermediate_size
    slot = Shard(cfg.expert_axes) if cfg.expert_axes else None
    inner = cfg.expert_tp
    moe = {
        "router": replicated(),
        "experts_gate_up": Layout((slot, Shard(("tp",), (Block("gate", f), Block("up", f))) if inner else None)),
        "experts_down": Layout((slot, None, Shard(("tp",)) if inner else None)),
        "expert_map": replicated(),
    }
    layers = []
    for i, layer in enumerate(dense["layers"]):
        if i in cfg.moe_layers:
            layer = {k: v for k, v in layer.items() if k not in ("gate_up", "down")} | moe
        layers.append(layer)
    return dense | {"layers": layers}


def init_cache(cfg: MoeConfig, mesh: Mesh, batch: int, max_seq_len: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The attention KV cache (as ``llama.init_cache``)."""
    return llama.init_cache(cfg.base, mesh, batch, max_seq_len, dtype)


# ---- routing and experts -----------------------------------------------------------------------
def route(logits: torch.Tensor, cfg: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, logical experts [T, k]) from router logits [T, E].

    Both families: softmax over all experts in float32, top-k; then renormalize over the k when
    ``norm_topk_prob`` (Qwen3-MoE's flag; Mixtral always, which equals a softmax over the top-k logits).
    """
    weights, experts = logits.float().softmax(-1).topk(cfg.top_k, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


def _slots(x: torch.Tensor, layer: dict, cfg: MoeConfig, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, physical slots), both [T, k], for tokens ``x [T, D]`` with dispatch indices ``index [T]``."""
    weights, experts = route(x @ layer["router"].T, cfg)
    table = layer["expert_map"]
    if table.shape[1] == 1:
        return weights, table[experts, 0]
    copies = (table >= 0).sum(-1)  # [E]
    return weights, table[experts, index[:, None] % copies[experts]]


def local_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``sum_k weights[:, k] * expert[ids[:, k]](x)`` over this rank's slots; ``ids`` -1 (another rank's slot) adds nothing.

    x: [N, D]; ids, weights: [N, k]; gate_up: [S_local, 2F, D]; down: [S_local, D, F] -> [N, D]. Static shapes
    either way (chosen by size): with fewer routed rows than local experts (decode) each row reads only its
    k experts' weights; otherwise every local expert runs on every row as one batched matmul, a row's
    weight being 0 for the slots it was not routed to. Neither graph grows with the expert count.
    """
    n, k = ids.shape
    if n * k < gate_up.shape[0]:
        chosen = ids.clamp(min=0)  # a -1 reads slot 0 and is weighted 0
        w = torch.where(ids >= 0, weights, 0.0).to(x.dtype)  # [N, k]
        gate, up = torch.einsum("nd,nkfd->nkf", x, gate_up[chosen]).chunk(2, dim=-1)  # [N, k, F] each
        y = torch.einsum("nkf,nkdf->nkd", F.silu(gate) * up, down[chosen])  # [N, k, D]
        return (y * w[..., None]).sum(1)
    slots = torch.arange(gate_up.shape[0], device=x.device)
    w = (weights[None] * (ids[None] == slots[:, None, None])).sum(-1).to(x.dtype)  # [S_local, N]
    gate, up = torch.matmul(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [S_local, N, F] each
    y = torch.matmul(F.silu(gate) * up, down.transpose(1, 2))  # [S_local, N, D]
    return (y * w[..., None]).sum(0)


def _gathered(x: torch.Tensor, layer: dict, cfg: MoeConfig, mesh: Mesh, n: int) -> torch.Tensor:
    """Small batches: all_gather the tokens, each rank computes its slots' share, reduce_scatter back."""
    t = x.shape[0]
    xa = all_gather(x, mesh, cfg.expert_axes, dim=0)  # [n t, D]
    weights, slots = _slots(xa, layer, cfg, torch.arange(n * t, device=x.device) % t)
    per = layer["experts_gate_up"].shape[0]
    ids = torch.where(slots // per == mesh.axis_index(cfg.expert_axes), slots % per, -1)
    part = local_experts(xa, ids, weights, layer["experts_gate_up"], layer["experts_down"])
    return reduce_scatter(part, mesh, cfg.expert_axes, dim=0)  # [t, D]


def _dispatched(x: torch.Tensor, layer: dict, cfg: MoeConfig, mesh: Mesh, n: int) -> torch.Tensor:
    """Larger batches: route here, all_to_all tokens + routing to the expert ranks, inverse all_to_all back.

    Static shapes with no dropped token mean a capacity of all ``t`` tokens per destination, so the tokens
    move as many bytes as in :func:`_gathered`; this path routes each token once (by its sender) instead of
    on every rank, at the price of one more collective (the routing).
    """
    (t, d), k = x.shape, cfg.top_k
    weights, slots = _slots(x, layer, cfg, torch.arange(t, device=x.device))
    per = layer["experts_gate_up"].shape[0]
    owner = torch.arange(n, device=x.device)[:, None, None]
    ids = torch.where(slots[None] // per == owner, slots[None] % per, -1)  # [n, t, k]: slot ids on rank j
    meta = torch.cat([ids.float(), weights[None].expand(n, t, k)], dim=-1)  # [n, t, 2k], ids exact in float32
    rx = all_to_all_single(x[None].expand(n, t, d).reshape(n * t, d), mesh, cfg.expert_axes)  # [n t, D] by source
    rmeta = all_to_all_single(meta.reshape(n * t, 2 * k), mesh, cfg.expert_axes)
    part = local_experts(rx, rmeta[:, :k].long(), rmeta[:, k:], layer["experts_gate_up"], layer["experts_down"])
    back = all_to_all_single(part, mesh, cfg.expert_axes)  # [n t, D]: each expert rank's share of my tokens
    return back.view(n, t, d).sum(0)


def moe_block(layer: dict, h: torch.Tensor, cfg: MoeConfig, mesh: Mesh) -> torch.Tensor:
    """The MoE MLP of one layer: ``h [B, S, D]`` -> ``[B, S, D]`` (replicated over tp, like a dense MLP's output)."""
    b, s, d = h.shape
    x = h.reshape(b * s, d)
    n = mesh.axis_size(cfg.expert_axes) if cfg.expert_axes else 1
    split = not cfg.expert_tp and mesh.axis_size("tp") > 1
    if split:  # tokens are identical on the tp ranks: each dispatches its own 1/tp of them
        tp, total = mesh.axis_size("tp"), x.shape[0]
        per = -(-total // tp)
        x = F.pad(x, (0, 0, 0, per * tp - total)).narrow(0, mesh.axis_index("tp") * per, per)
    if n == 1:
        weights, slots = _slots(x, layer, cfg, torch.arange(x.shape[0], device=x.device))
        y = local_experts(x, slots, weights, layer["experts_gate_up"], layer["experts_down"])
    elif x.shape[0] <= cfg.dispatch_threshold:
        y = _gathered(x, layer, cfg, mesh, n)
    else:
        y = _dispatched(x, layer, cfg, mesh, n)
    if split:
        y = all_gather(y, mesh, "tp", dim=0)[:total]
    if cfg.expert_tp:
        y = all_reduce(y, mesh, "tp")  # each expert's down projection is row-parallel
    return y.view(b, s, d)


# ---- the forward -----------------------------------------------------------------------------
def _attention(layer: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, slot: torch.Tensor,
               kv: tuple[torch.Tensor, torch.Tensor], cfg: llama.LlamaConfig, mesh: Mesh, attention: str = "sdpa") -> torch.Tensor:
    """One attention block as in ``llama.forward`` (tp column/row parallel); returns the residual update."""
    b, s, _ = x.shape
    hd = cfg.head_dim
    nh, nkv = llama.local_heads(cfg, mesh.axis_size("tp"))
    h = llama.rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    qkv = h @ layer["qkv"].T
    if "qkv_bias" in layer:
        qkv = qkv + layer["qkv_bias"]
    q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1))
    if "q_norm" in layer:
        q, k = llama.rms_norm(q, layer["q_norm"], cfg.rms_norm_eps), llama.rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    q, k = llama._rotate(q, cos, sin), llama._rotate(k, cos, sin)
    kv[0].scatter_(2, slot, k)
    kv[1].scatter_(2, slot, v)
    keys, values = (c.repeat_interleave(nh // nkv, dim=1) for c in kv)
    attn = llama.attend(q, keys, values, mask, attention).transpose(1, 2).reshape(b, s, nh * hd)
    return all_reduce(attn @ layer["o_proj"].T, mesh, "tp")


def _dense_mlp(layer: dict, h: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    gate, up = (h @ layer["gate_up"].T).chunk(2, dim=-1)
    return all_reduce((F.silu(gate) * up) @ layer["down"].T, mesh, "tp")


def forward(
    params: dict,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    cache: list[tuple[torch.Tensor, torch.Tensor]],
    mesh: Mesh,
    prefetched: list[torch.Tensor] | None = None,
    *,
    attention: str = "sdpa",
) -> torch.Tensor:
    """Logits ``[B, S, V]`` for ``tokens [B, S]`` at ``positions [B, S]`` (same contract as ``llama.forward``).

    Every rank of the expert axes must call it with the same token count (the exchange spans them).
    Layer-sharded weights (``prefetched``) are not supported for MoE models.
    """
    if prefetched or "series" in params:
        raise ValueError("moe.forward: layer-sharded weights (params['series'], prefetched) are supported for the dense families only")
    cfg: MoeConfig = params["config"]
    base = cfg.base
    b, s = tokens.shape
    _, nkv = llama.local_heads(base, mesh.axis_size("tp"))
    x = llama.embed(params["embed"], tokens, mesh)  # [B, S, D]
    cos, sin = llama.rope(positions, base, x.dtype)
    mask = llama.attention_mask(positions, cache[0][0].shape[2], base.sliding_window)
    slot = positions[:, None, :, None].expand(b, nkv, s, base.head_dim)
    for layer, kv in zip(params["layers"], cache):
        x = x + _attention(layer, x, cos, sin, mask, slot, kv, base, mesh, attention)
        h = llama.rms_norm(x, layer["mlp_norm"], base.rms_norm_eps)
        x = x + (moe_block(layer, h, cfg, mesh) if "router" in layer else _dense_mlp(layer, h, mesh))
    x = llama.rms_norm(x, params["norm"], base.rms_norm_eps)
    head = params["embed"] if base.tie_word_embeddings else params["lm_head"]
    return all_gather(x @ head.T, mesh, "tp", dim=-1)


def with_plan(cfg: MoeConfig, **plan: Any) -> MoeConfig:
    """``cfg`` with other plan fields (``expert_axes``, ``num_slots``, ``max_copies``, ``dispatch_threshold``)."""
    allowed = {"expert_axes", "num_slots", "max_copies", "dispatch_threshold"}
    unknown = set(plan) - allowed
    if unknown:
        raise TypeError(f"with_plan: unknown plan fields {sorted(unknown)}; allowed: {sorted(allowed)}")
    if "expert_axes" in plan:
        plan["expert_axes"] = (plan["expert_axes"],) if isinstance(plan["expert_axes"], str) else tuple(plan["expert_axes"])
    return dataclasses.replace(cfg, **plan)
