"""The README's main job: shard a small transformer-shaped tree over local gloo ranks and prove it.

Each rank builds the same seeded full tree, takes its shard with ``shard``, runs a
tensor-parallel MLP block written with an explicit ``all_reduce`` (eager and compiled with
inductor) against the unsharded reference, and gathers every leaf back bit for bit.
No network, no downloads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .collectives import all_reduce
from .layout import Block, Cyclic, Layout, Shard, fused, replicated, sharded
from .launch import LocalWorld, RankContext
from .shard import gather, shard
from .tree import flatten_with_paths


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    layers: int = 4
    hidden: int = 64
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 8
    ffn: int = 128
    vocab: int = 256
    seed: int = 0


def full_params(cfg: DemoConfig) -> dict:
    g = torch.Generator().manual_seed(cfg.seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    qkv_rows = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    return {
        "embed": w(cfg.vocab, cfg.hidden),
        "layers": {
            "qkv": w(cfg.layers, qkv_rows, cfg.hidden),
            "o_proj": w(cfg.layers, cfg.hidden, cfg.heads * cfg.head_dim),
            "gate_up": w(cfg.layers, 2 * cfg.ffn, cfg.hidden),
            "down": w(cfg.layers, cfg.hidden, cfg.ffn),
            "norm": torch.ones(cfg.layers, cfg.hidden),
        },
    }


def param_specs(cfg: DemoConfig, layer_axis: str = "dp") -> dict:
    """The parallel plan as data: GQA-fused qkv and [gate|up] column-parallel, o_proj/down row-parallel,
    vocab-parallel embedding, and the o_proj series layer-sharded (layer l on dp rank l % n)."""
    hd = cfg.head_dim
    qkv = [Block("q", cfg.heads * hd, hd), Block("k", cfg.kv_heads * hd, hd, True), Block("v", cfg.kv_heads * hd, hd, True)]
    return {
        "embed": sharded(0, "tp"),
        "layers": {
            "qkv": fused(1, qkv, "tp"),
            "o_proj": Layout((Cyclic(layer_axis, cfg.layers), None, Shard(("tp",)))),
            "gate_up": fused(1, [Block("gate", cfg.ffn), Block("up", cfg.ffn)], "tp"),
            "down": sharded(2, "tp"),
            "norm": replicated(),
        },
    }


def mlp_block(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, mesh, axis: str = "tp") -> torch.Tensor:
    """SwiGLU MLP; ``gate_up`` is this rank's ``[gate_r | up_r]``, ``down`` its input-dim shard."""
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)  # x: [T, D] -> [T, F/tp] each
    return all_reduce((F.silu(gate) * up) @ down.T, mesh, axis)  # row-parallel: partial sums -> [T, D]


def _run_rank(ctx: RankContext, axes: dict[str, int], cfg: DemoConfig) -> dict:
    mesh = ctx.mesh(axes)
    full, specs = full_params(cfg), param_specs(cfg)
    local = shard(full, specs, mesh)
    x = torch.randn(5, cfg.hidden, generator=torch.Generator().manual_seed(1))

    def forward(layers: dict, x: torch.Tensor) -> torch.Tensor:
        for i in range(cfg.layers):
            x = x + mlp_block(x, layers["gate_up"][i], layers["down"][i], mesh)
        return x

    want = x
    for i in range(cfg.layers):  # unsharded reference
        gate, up = (want @ full["layers"]["gate_up"][i].T).chunk(2, dim=-1)
        want = want + (F.silu(gate) * up) @ full["layers"]["down"][i].T
    eager = forward(local["layers"], x)
    mesh.init_groups()
    t0 = time.perf_counter()
    compiled = torch.compile(forward, fullgraph=True)(local["layers"], x)
    compile_s = time.perf_counter() - t0
    back = gather(local, specs, mesh)
    leaves = dict(flatten_with_paths(local))
    return {
        "coordinate": mesh.coordinate,
        "bytes": {p: t.numel() * t.element_size() for p, t in leaves.items()},
        "shapes": {p: tuple(t.shape) for p, t in leaves.items()},
        "eager_err": (eager - want).abs().max().item(),
        "compiled_err": (compiled - want).abs().max().item(),
        "compile_s": compile_s,
        "gather_exact": all(torch.equal(a, b) for (_, a), (_, b) in zip(flatten_with_paths(back), flatten_with_paths(full))),
    }


def run_demo(dp: int = 2, tp: int = 2, *, timeout: float = 600.0, tolerance: float = 1e-4) -> int:
    """Run the demo on ``dp * tp`` local ranks, print a report, return 0 if every check passed."""
    cfg = DemoConfig()
    axes = {"dp": dp, "tp": tp}
    full = full_params(cfg)
    full_bytes = {p: t.numel() * t.element_size() for p, t in flatten_with_paths(full)}
    print(f"functional-npu demo: {dp * tp} local gloo ranks, mesh {axes}, model {cfg}")
    for path, spec in flatten_with_paths(param_specs(cfg), is_leaf=lambda s: isinstance(s, Layout)):
        print(f"  {path:<16} {str(tuple(dict(flatten_with_paths(full))[path].shape)):<16} {spec!r}")
    t0 = time.perf_counter()
    with LocalWorld(dp * tp, timeout=timeout) as world:
        results = world.run(_run_rank, axes, cfg)
    print("\n| rank | coordinate | local bytes | of full | o_proj layers held | TP-MLP err eager | compiled | gather exact |")
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for rank, r in enumerate(results):
        local, total = sum(r["bytes"].values()), sum(full_bytes.values())
        good = r["gather_exact"] and r["eager_err"] < tolerance and r["compiled_err"] < tolerance
        ok &= good
        print(
            f"| {rank} | {r['coordinate']} | {local:,} | {local / total:.1%} | {r['shapes']['layers.o_proj'][0]} of {cfg.layers} "
            f"| {r['eager_err']:.1e} | {r['compiled_err']:.1e} | {r['gather_exact']} |"
        )
    print(f"\ncompile (inductor, rank 0): {results[0]['compile_s']:.1f}s; total wall time {time.perf_counter() - t0:.1f}s")
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1
