"""Train-to-inference weight sync: ``reshard`` from a Megatron TP=2 layout on 2 gloo ranks.

    python -m benchmarks reshard [--quick] [--layers 22] [--repeat 3] [--no-thp]

A Qwen3-style model (hidden 512, 8 heads, 4 KV heads, vocab 32000, fp32; 22 layers is about 100M
params) is laid out as Megatron-Core holds it at TP=2 (grouped ``linear_qkv``, ``[gate_r|up_r]``
``linear_fc1``, row-parallel ``linear_proj``/``linear_fc2``, vocab-parallel embedding and output)
and resharded to three inference layouts: TP=1 replicated, TP=2 in this library's fused
``[q|k|v]`` order, and layer-sharded (layer l whole on rank l % 2, the rest as TP=2).

Per target and rank 0: bytes received against the lower bound (bytes the rank needs and does not
hold) and against all-gather-then-slice (every TP-sharded tensor gathered whole, one at a time, then
sliced); time and GB/s over the destination bytes written, against a same-run ``copy_`` of the
same bytes into a buffer already touched (memcpy) and into fresh memory (``clone``: what any
transform returning new tensors pays for first-touch page faults on CPU); and the same-run time
of all-gather-then-slice itself (``gather`` then ``shard``). By default the ranks run with
``THP_MEM_ALLOC_ENABLE=1`` (torch backs large CPU tensors with transparent huge pages, as a caching
device allocator would avoid the cost altogether); ``--no-thp`` measures plain 4 KiB pages.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from functional_npu import Cyclic, gather, leaf_specs, plan_reshard, replicated, reshard, shard
from functional_npu.core import flatten_with_paths
from functional_npu.interop import megatron_specs, stack_layers, stacked_specs
from functional_npu.models.llama import abstract_params, init_params, param_specs
from functional_npu.runtime import LocalWorld

from .configs import FULL
from .flags import count
from .timing import best_time


def _nbytes(tree) -> int:
    return sum(x.numel() * x.element_size() for _, x in flatten_with_paths(tree))


def _copy_times(a: torch.Tensor, b: torch.Tensor, repeat: int) -> tuple[float, float]:
    """Best of ``repeat`` times of ``b.copy_(a)`` and of ``a.clone()``: the memcpy and clone baselines."""
    t_copy = best_time(lambda: b.copy_(a), repeat)  # into a buffer already touched
    t_clone = best_time(lambda: a.clone(), repeat)  # into fresh memory, as a functional transform writes
    return t_copy, t_clone


def _rank(ctx, layers: int, repeat: int) -> dict:
    torch.set_num_threads(1)
    cfg = dataclasses.replace(FULL, num_layers=layers)
    mesh = ctx.mesh({"tp": 2})
    full = stack_layers(init_params(cfg, seed=0))
    src = stacked_specs(megatron_specs(cfg))
    train = shard(full, src, mesh)  # what Megatron TP=2 rank holds
    del full
    tp2 = stacked_specs(param_specs(cfg))
    whole_layers = param_specs(cfg) | {
        "layers": [{k: replicated() for k in param_specs(cfg)["layers"][0]}] * cfg.num_layers
    }
    layer_sharded = stacked_specs(
        whole_layers, Cyclic("tp", cfg.num_layers)
    )  # layer l whole on rank l % 2; embed/lm_head TP=2
    targets = {"tp1_replicated": replicated(), "tp2_fused_qkv": tp2, "layer_sharded": layer_sharded}
    shapes = {p: (tuple(x.shape), x.dtype) for p, x in flatten_with_paths(stack_layers(abstract_params(cfg)))}
    out = {"params": sum(torch.Size(s).numel() for s, _ in shapes.values()), "train_bytes": _nbytes(train)}
    for name, dst in targets.items():
        t0 = time.perf_counter()
        plan = plan_reshard(shapes, leaf_specs(src, train), leaf_specs(dst, train), mesh)
        plan_s = time.perf_counter() - t0
        result = reshard(train, src, dst, mesh, plan=plan)  # warm-up (groups, allocator)
        written = _nbytes(result)
        del result
        t = best_time(lambda: reshard(train, src, dst, mesh, plan=plan), repeat)
        a, b = torch.empty(written // 4), torch.empty(written // 4)
        t_copy, t_clone = _copy_times(a, b, repeat)
        del a, b
        t_ags = best_time(lambda: shard(gather(train, src, mesh), dst, mesh), max(1, repeat - 1))
        traffic = plan.traffic[mesh.rank]
        out[name] = {
            "plan_s": plan_s,
            "time_s": t,
            "memcpy_s": t_copy,
            "clone_s": t_clone,
            "allgather_slice_s": t_ags,
            "written": written,
            "received": traffic.received,
            "sent": traffic.sent,
            "lower_bound": traffic.lower_bound,
            "allgather_slice_bytes": traffic.allgather_slice,
            "local_copy": traffic.local_copy,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks reshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=22, help="decoder layers (22: about 100M params)")
    parser.add_argument("--repeat", type=count, default=3, help="best of N timings")
    parser.add_argument("--quick", action="store_true", help="4 layers, best of 2 (well under a minute)")
    parser.add_argument(
        "--no-thp",
        action="store_true",
        help="plain 4 KiB pages for torch's CPU allocations (first-touch page faults dominate)",
    )
    args = parser.parse_args(argv)
    if not args.no_thp:  # torch's CPU allocator backs large tensors with transparent huge pages; the ranks inherit it
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    layers, repeat = (4, 2) if args.quick else (args.layers, args.repeat)
    with LocalWorld(2, threads=1) as world:
        results = world.run(_rank, layers, repeat, timeout=1800)
    r0 = results[0]
    print(
        f"model: Qwen3-style, {layers} layers, {r0['params'] / 1e6:.1f}M params fp32; "
        f"source: Megatron TP=2 on 2 gloo ranks "
        f"({r0['train_bytes'] / 2**20:.0f} MiB per rank); figures for rank 0, best of {repeat}; "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '0')}\n"
    )
    print(
        "| target | received | lower bound | all-gather-then-slice | fewer bytes | reshard | GB/s (written) | "
        "memcpy GB/s | share | clone GB/s | share | all-gather-then-slice time |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("tp1_replicated", "tp2_fused_qkv", "layer_sharded"):
        x = r0[name]
        ratio = "inf (0 bytes)" if x["received"] == 0 else f"{x['allgather_slice_bytes'] / x['received']:.2f}x"
        gbs, mgbs, cgbs = (x["written"] / x[k] / 1e9 for k in ("time_s", "memcpy_s", "clone_s"))
        print(
            f"| {name} | {x['received'] / 2**20:.1f} MiB | {x['lower_bound'] / 2**20:.1f} MiB | "
            f"{x['allgather_slice_bytes'] / 2**20:.1f} MiB | "
            f"{ratio} | {x['time_s'] * 1e3:.0f} ms | {gbs:.2f} | {mgbs:.2f} | {gbs / mgbs:.0%} | "
            f"{cgbs:.2f} | {gbs / cgbs:.0%} | {x['allgather_slice_s'] * 1e3:.0f} ms |"
        )
    print(
        "\nplan time (pure Python, once per layout pair): "
        + ", ".join(f"{n} {r0[n]['plan_s']:.2f}s" for n in ("tp1_replicated", "tp2_fused_qkv", "layer_sharded"))
    )
