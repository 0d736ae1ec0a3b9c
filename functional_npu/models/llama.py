"""The Llama family as pure functions: Llama 2/3 (llama3 / linear rope scaling, tied embeddings),
Mistral (sliding window), Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm).

Params are a tree of local shards plus the static config (``params["config"]``, a leafless pytree
node, so ``shard``/``gather`` carry it along)::

    {"config": LlamaConfig, "embed": [V, D], "norm": [D], "lm_head": [V, D] (untied only),
     "layers": [{"attn_norm": [D], "qkv": [(H+2K)*hd, D], "qkv_bias": [(H+2K)*hd] (Qwen2),
                 "q_norm": [hd], "k_norm": [hd] (Qwen3), "o_proj": [D, H*hd],
                 "mlp_norm": [D], "gate_up": [2F, D], "down": [D, F]}, ...]}

Tensor parallelism over the mesh axis ``tp`` is written out: ``[q|k|v]`` and ``[gate|up]`` are
column-parallel (KV heads replicated when tp > num_kv_heads), ``o_proj`` and ``down`` are
row-parallel followed by ``all_reduce``, the embedding is vocab-parallel (masked lookup +
``all_reduce``) and the lm_head gives local logits + ``all_gather``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..parallel import prefetch
from ..core.collectives import all_gather, all_reduce
from ..core.layout import Block, Layout, fused, replicated, sharded
from ..core.mesh import Mesh
from ..core.tree import map_with_path, register_static

__all__ = ["LlamaConfig", "ARCHITECTURES", "HF_NAMES", "abstract_params", "init_params", "param_specs", "forward", "init_cache", "local_heads", "attend"]

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")

# HF tensor names of each param leaf, in block order ({i}: layer index). One table per family.
HF_NAMES: dict[str, list[str]] = {
    "embed": ["model.embed_tokens.weight"],
    "norm": ["model.norm.weight"],
    "lm_head": ["lm_head.weight"],
    "attn_norm": ["model.layers.{i}.input_layernorm.weight"],
    "qkv": [f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"],
    "qkv_bias": [f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"],
    "q_norm": ["model.layers.{i}.self_attn.q_norm.weight"],
    "k_norm": ["model.layers.{i}.self_attn.k_norm.weight"],
    "o_proj": ["model.layers.{i}.self_attn.o_proj.weight"],
    "mlp_norm": ["model.layers.{i}.post_attention_layernorm.weight"],
    "gate_up": ["model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"],
    "down": ["model.layers.{i}.mlp.down_proj.weight"],
}


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    """Static model config, read from a HF ``config.json`` by :meth:`from_hf`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    @staticmethod
    def from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
        """Build from a parsed HF ``config.json``; clear errors for unsupported features."""
        archs = hf.get("architectures") or [None]
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(hf.get(key), int):
                raise ValueError(f"config.json: {key!r} must be an int, got {hf.get(key)!r}")
        if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias"):
            raise ValueError(f"config.json: only silu MLPs without bias are supported (hidden_act={hf.get('hidden_act')!r}, mlp_bias={hf.get('mlp_bias')!r})")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"config.json: rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        heads = hf["num_attention_heads"]
        sliding = hf.get("sliding_window") if arch == "MistralForCausalLM" or hf.get("use_sliding_window") else None
        return LlamaConfig(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_positions=int(rope.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding,
        )


    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict for this config (read back by :meth:`from_hf`)."""
        rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type != "default":
            rope["factor"] = self.rope_factor
        if self.rope_type == "llama3":
            rope |= {"low_freq_factor": self.rope_low_freq_factor, "high_freq_factor": self.rope_high_freq_factor,
                     "original_max_position_embeddings": self.rope_original_max_positions}
        return {
            "architectures": [self.architecture],
            "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[self.architecture],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_parameters": rope, "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias, "sliding_window": self.sliding_window,
        }


# The config rides along in the params tree as a node with no leaves: pytree maps keep it.
register_static(LlamaConfig)


# ---- the parallel plan ------------------------------------------------------------------------
def _layer_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    shapes = {"attn_norm": (d,), "qkv": (qkv, d), "o_proj": (d, cfg.num_heads * hd), "mlp_norm": (d,), "gate_up": (2 * f, d), "down": (d, f)}
    if cfg.qkv_bias:
        shapes["qkv_bias"] = (qkv,)
    if cfg.qk_norm:
        shapes |= {"q_norm": (hd,), "k_norm": (hd,)}
    return shapes


def abstract_params(cfg: LlamaConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "meta") -> dict[str, Any]:
    """The full (unsharded) params tree with empty tensors (on the meta device by default: no memory)."""

    def make(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    top: dict[str, Any] = {"config": cfg, "embed": make((cfg.vocab_size, cfg.hidden_size)), "norm": make((cfg.hidden_size,))}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = make((cfg.vocab_size, cfg.hidden_size))
    return top | {"layers": [{k: make(v) for k, v in _layer_shapes(cfg).items()} for _ in range(cfg.num_layers)]}


def init_params(cfg: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Full params with seeded random weights (std 0.02, norms 1): an embedded model needing no download."""
    g = torch.Generator().manual_seed(seed)

    def fill(path: str, x: torch.Tensor) -> torch.Tensor:
        if path.endswith("norm"):
            return torch.ones(x.shape, dtype=dtype)
        return (torch.randn(x.shape, generator=g) * 0.02).to(dtype)

    return map_with_path(fill, abstract_params(cfg))


def qkv_blocks(cfg: LlamaConfig) -> list[Block]:
    hd = cfg.head_dim
    return [Block("q", cfg.num_heads * hd, hd), Block("k", cfg.num_kv_heads * hd, hd, True), Block("v", cfg.num_kv_heads * hd, hd, True)]


def param_specs(cfg: LlamaConfig) -> dict[str, Any]:
    """The tensor-parallel plan over mesh axis ``tp`` as a tree of layouts (a prefix of the params)."""
    qkv = fused(0, qkv_blocks(cfg), "tp")
    layer: dict[str, Layout] = {
        "attn_norm": replicated(),
        "qkv": qkv,
        "o_proj": sharded(1, "tp"),
        "mlp_norm": replicated(),
        "gate_up": fused(0, [Block("gate", cfg.intermediate_size), Block("up", cfg.intermediate_size)], "tp"),
        "down": sharded(1, "tp"),
    }
    if cfg.qkv_bias:
        layer["qkv_bias"] = qkv
    if cfg.qk_norm:
        layer |= {"q_norm": replicated(), "k_norm": replicated()}
    top: dict[str, Any] = {"embed": sharded(0, "tp"), "norm": replicated(), "layers": [layer] * cfg.num_layers}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = sharded(0, "tp")
    return top


def local_heads(cfg: LlamaConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) on one tp rank; a KV head is replicated when tp > num_kv_heads."""
    return cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp)


# ---- building blocks ---------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    hd = cfg.head_dim
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if cfg.rope_type == "linear":
        return freq / cfg.rope_factor
    if cfg.rope_type == "llama3":
        old, lo, hi, factor = cfg.rope_original_max_positions, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old / lo, freq / factor, freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    return freq


def rope(positions: torch.Tensor, cfg: LlamaConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[..., None].float() * inv_freq(cfg).to(positions.device)  # [B, S, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, S, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def embed(table: torch.Tensor, tokens: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Vocab-parallel lookup: this rank holds rows [start, start + V/tp); others are zero, then summed."""
    rows = table.shape[0]
    start = mesh.axis_index("tp") * rows
    local = tokens - start
    hit = (local >= 0) & (local < rows)
    x = F.embedding(local.clamp(0, rows - 1), table) * hit[..., None].to(table.dtype)
    return all_reduce(x, mesh, "tp")


def attention_mask(positions: torch.Tensor, cache_len: int, window: int | None) -> torch.Tensor:
    """[B, 1, S, cache_len] boolean: a query at position p sees keys at positions <= p (and > p - window)."""
    kv = torch.arange(cache_len, device=positions.device)
    q = positions[:, None, :, None]
    mask = kv <= q
    if window is not None:
        mask = mask & (kv > q - window)
    return mask


def init_cache(cfg: LlamaConfig, mesh: Mesh, batch: int, max_seq_len: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A static KV cache: per layer ``(k, v)`` of shape ``[batch, local KV heads, max_seq_len, head_dim]``."""
    _, kv = local_heads(cfg, mesh.axis_size("tp"))
    return [(torch.zeros(batch, kv, max_seq_len, cfg.head_dim, dtype=dtype), torch.zeros(batch, kv, max_seq_len, cfg.head_dim, dtype=dtype)) for _ in range(cfg.num_layers)]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, kind: str = "sdpa") -> torch.Tensor:
    """Masked attention ``[B, H, S, hd]``: SDPA, or ``"math"`` (matmul + softmax: every op has a GE converter)."""
    if kind == "sdpa":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    if kind != "math":
        raise ValueError(f"attention must be 'sdpa' or 'math', got {kind!r}")
    scores = (q @ keys.transpose(-1, -2)) * (q.shape[-1] ** -0.5)  # [B, H, S, C]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values


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
    """Logits ``[B, S, V]`` for ``tokens [B, S]`` at absolute ``positions [B, S]``.

    The KV cache is donated: each layer's keys and values are written into ``cache`` in place at
    ``positions`` (a decode step is ``S == 1`` with each sequence's own position). Padded slots
    may hold garbage at positions a query never sees.

    Layer-sharded series (``params["series"]``) are fetched from their owners with broadcasts
    issued ``k`` layers ahead, where ``prefetched`` carries the first ``k`` layers' weights from
    the previous step and is replaced in place by the next step's (see :mod:`functional_npu.prefetch`).
    ``attention="math"`` writes attention as matmul + softmax (the torchair path).
    """
    cfg: LlamaConfig = params["config"]
    b, s = tokens.shape
    hd = cfg.head_dim
    nh, nkv = local_heads(cfg, mesh.axis_size("tp"))
    x = embed(params["embed"], tokens, mesh)  # [B, S, D]
    cos, sin = rope(positions, cfg, x.dtype)
    mask = attention_mask(positions, cache[0][0].shape[2], cfg.sliding_window)
    slot = positions[:, None, :, None].expand(b, nkv, s, hd)
    step = prefetch.prefetch_step(params, prefetched)  # k: layers of look-ahead
    ahead = prefetch.carried(params, prefetched)
    for i, (k_cache, v_cache) in enumerate(cache):
        ahead |= prefetch.issue(params, i + step, mesh)  # layer i + k's series weights, from their owners
        layer = params["layers"][i] | ahead.pop(i, {})
        h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        qkv = h @ layer["qkv"].T  # column-parallel: [B, S, (nh + 2 nkv) hd]
        if "qkv_bias" in layer:
            qkv = qkv + layer["qkv_bias"]
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in (q, k, v))  # [B, heads, S, hd]
        if "q_norm" in layer:
            q, k = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps), rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k_cache.scatter_(2, slot, k)
        v_cache.scatter_(2, slot, v)
        keys = k_cache.repeat_interleave(nh // nkv, dim=1)
        values = v_cache.repeat_interleave(nh // nkv, dim=1)
        attn = attend(q, keys, values, mask, attention)  # [B, nh, S, hd]
        attn = attn.transpose(1, 2).reshape(b, s, nh * hd)
        x = x + all_reduce(attn @ layer["o_proj"].T, mesh, "tp")  # row-parallel
        h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
        gate, up = (h @ layer["gate_up"].T).chunk(2, dim=-1)  # column-parallel [gate_r | up_r]
        x = x + all_reduce((F.silu(gate) * up) @ layer["down"].T, mesh, "tp")  # row-parallel
    prefetch.hand_over(ahead, prefetched, len(cache))
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return all_gather(x @ head.T, mesh, "tp", dim=-1)  # local vocab slice -> [B, S, V]
