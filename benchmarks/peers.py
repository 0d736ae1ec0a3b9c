"""Peers in the same run (``bench``'s JSON key ``peers``): this library against torch's and transformers' own
distributed paths, on the same gloo ranks and the same weights.

``reshard``: the move a training state makes to serve. Every tensor of the bench model's checkpoint starts as
FSDP2 holds it (rows over the world) and goes to its slice of the tp plan (q/k/v and gate/up rows, o/down
columns, the rest as the plan places it). This library plans the whole move as one ``all_to_all``;
``DTensor.redistribute`` moves each tensor with the collectives its placements imply. Both must give the same
bits. Reported: seconds per move (median and spread of interleaved rounds, timed between barriers so the
slowest rank counts) and the bytes each rank receives from the others, both counted by one dispatch mode at the
collectives each system dispatches (:class:`benchmarks.counting.ReceivedBytes`), against the lower bound: the bytes
a rank needs and does not hold, from the element indices each layout gives it (no planner code involved).

``decode_tp``: decode tokens/s at tp = the world, this library compiled against transformers' own tensor
parallelism (``DistributedConfig(tp_plan="auto")``: DTensor weights, eager ``generate``), loaded from the same
checkpoint on the same ranks and timed in interleaved rounds; their greedy tokens must agree. transformers needs
``accelerate`` to load with a tp plan (the ``bench`` extra installs it); without it the peer is skipped, with
the reason in the JSON.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from functional_npu.core.dtensor import placements_of, to_dtensor
from functional_npu.core.layout import Layout, Shard, sharded
from functional_npu.core.reshard import plan_reshard, reshard
from functional_npu.core.shard import shard
from functional_npu.core.tree import flatten_with_paths
from functional_npu.models import family_of
from functional_npu.runtime.hf_layout import stored_tensors
from functional_npu.runtime.launch import RankContext
from functional_npu.runtime.plan import check_plan

from .counting import ReceivedBytes, need_of_layouts
from .formats import fnpu_runner
from .timing import interleaved, ratio, rounds, seconds, stats

__all__ = ["reshard_peer", "decode_tp_peer", "peers_report"]


def reshard_peer(ctx: RankContext, cfg: Any, repeat: int, seed: int = 0) -> dict[str, Any]:
    """Rank job: this library's ``reshard`` against ``DTensor.redistribute`` on the FSDP2-to-tp move of every HF
    tensor of ``cfg`` (random weights), ``repeat`` interleaved rounds on ``{"tp": world}``."""
    mesh = ctx.mesh({"tp": ctx.world_size})
    meta, layouts = check_plan(cfg, mesh, where="bench peers")
    stored = stored_tensors(family_of(cfg), cfg, dict(flatten_with_paths(meta)), layouts)
    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(t.shape, generator=g) for n, t in stored.items()}
    src = {n: sharded(0, "tp") for n in stored}
    dst = {n: _plain(t.layout, mesh.axis_size("tp"), n) for n, t in stored.items()}
    local = shard(full, src, mesh)
    plan = plan_reshard({n: (t.shape, torch.float32) for n, t in stored.items()}, src, dst, mesh)
    dm = mesh.device_mesh()
    dts = {n: to_dtensor(local[n], src[n], mesh, path=n) for n in local}
    want = {n: placements_of(dst[n], mesh, path=n) for n in dst}

    def ours() -> dict[str, torch.Tensor]:
        return {n: _settled(x) for n, x in reshard(local, src, dst, mesh, plan=plan).items()}

    def theirs() -> dict[str, torch.Tensor]:
        return {n: _settled(dt.redistribute(dm, want[n]).to_local()) for n, dt in dts.items()}

    with ReceivedBytes() as ours_counted:
        a = ours()
    with ReceivedBytes() as theirs_counted:
        b = theirs()
    ours(), theirs()  # a second warm-up: the allocator settles (fresh pages on the first rounds, not after)
    same = all(torch.equal(a[n], b[n]) for n in a)
    systems: dict[str, Callable[[], Any]] = {"fnpu_reshard": ours, "dtensor_redistribute": theirs}
    times = rounds({name: functools.partial(_between_barriers, fn) for name, fn in systems.items()}, repeat)
    need = need_of_layouts({n: (t.shape, torch.float32) for n, t in stored.items()}, src, dst, mesh, ctx.rank)
    counted = {"fnpu_reshard": ours_counted, "dtensor_redistribute": theirs_counted}
    return {
        "tensors": len(stored),
        "bytes_total": sum(x.numel() * x.element_size() for x in full.values()),
        "same_bits": same,
        "seconds": {k: stats(v) for k, v in times.items()},
        "speedup": ratio(times["dtensor_redistribute"], times["fnpu_reshard"]),
        # counted at the collectives each dispatched (benchmarks.counting), against the bytes this rank needs and
        # does not hold, from the element indices each layout gives it
        "received_bytes": {k: c.received for k, c in counted.items()},
        "lower_bound_bytes": need.missing,
        # reshard writes every output byte fresh (it never aliases its input), so it copies every byte it needs and
        # holds; DTensor hands back a local tensor whose placement does not change as it is
        "copied_locally_bytes": need.held,
        "collectives": {k: c.collectives for k, c in counted.items()},
        "collective_ops": {k: dict(c.calls) for k, c in counted.items()},
    }


def decode_tp_peer(ctx: RankContext, path: str, prompt: list[int], new: int, repeat: int) -> dict[str, Any]:
    """Rank job: this library compiled at tp = world on the checkpoint at ``path`` (its first-call time, then
    decode and prefill tokens/s) and, in the same interleaved rounds, transformers' tp plan; ``{"fnpu": ...,
    "peer": ...}``, the peer with both systems' rates, their ratio per round and whether their tokens agree."""
    t0 = time.perf_counter()
    ours, _ = fnpu_runner(path, ctx.mesh({"tp": ctx.world_size}), prompt, new, greedy_head=True)
    ours(1, new)
    ours(1, 1)
    compile_s = time.perf_counter() - t0
    systems: dict[str, Callable[[int, int], Any]] = {"fnpu_compiled_tp": ours}
    same = None
    if importlib.util.find_spec("accelerate") is not None:
        systems["hf_tp_plan_auto"] = theirs = _transformers_tp(path, prompt, ctx.world_size)
        same = [list(t) for t in ours(1, new)] == theirs(1, new)[:, len(prompt) :].tolist()
    runs = {k: v[1] for k, v in interleaved(systems, (1,), new, len(prompt), repeat).items()}
    fnpu = {"decode": runs["fnpu_compiled_tp"]["decode"], "prefill": runs["fnpu_compiled_tp"]["prefill"]}
    if same is None:
        return {
            "fnpu": fnpu | {"compile_s": compile_s},
            "peer": {"skipped": "transformers loads a tp plan only with accelerate (pip install accelerate)"},
        }
    peer = {
        "tp": ctx.world_size,
        "same_tokens": same,
        "decode_tok_s": {k: stats(v["decode"]) for k, v in runs.items()},
        "prefill_tok_s": {k: stats(v["prefill"]) for k, v in runs.items()},
        "decode_ratio": ratio(runs["fnpu_compiled_tp"]["decode"], runs["hf_tp_plan_auto"]["decode"]),
    }
    return {"fnpu": fnpu | {"compile_s": compile_s}, "peer": peer}


def peers_report(peers: dict[str, Any]) -> str:
    """The peers as printed lines (medians, spread, ratio from the same rounds)."""
    lines = []
    d = peers["decode_tp"]
    if "skipped" in d:
        lines.append(f"decode at tp 2 against transformers' tp plan: skipped ({d['skipped']})")
    else:
        r, rates = d["decode_ratio"], d["decode_tok_s"]
        lines.append(
            f"decode at tp {d['tp']}: this library {rates['fnpu_compiled_tp']['median']:.1f} tok/s, transformers' "
            f"tp_plan='auto' {rates['hf_tp_plan_auto']['median']:.1f} tok/s: {r['median']:.2f}x "
            f"({r['min']:.2f} to {r['max']:.2f} over the rounds), tokens {'equal' if d['same_tokens'] else 'DIFFER'}"
        )
    x = peers["reshard"]
    t, b = x["seconds"], x["received_bytes"]
    lines.append(
        f"FSDP2 rows to the tp plan ({x['tensors']} tensors, {x['bytes_total'] / 2**20:.1f} MiB): reshard "
        f"{x['speedup']['median']:.2f}x faster ({x['speedup']['min']:.2f} to {x['speedup']['max']:.2f}), "
        f"{t['fnpu_reshard']['median'] * 1e3:.1f} ms, {b['fnpu_reshard'] / 2**20:.1f} MiB in "
        f"{x['collectives']['fnpu_reshard']} collective; DTensor.redistribute "
        f"{t['dtensor_redistribute']['median'] * 1e3:.1f} ms, {b['dtensor_redistribute'] / 2**20:.1f} MiB in "
        f"{x['collectives']['dtensor_redistribute']} collectives (bytes received by rank 0, counted at the "
        f"collectives); lower bound {x['lower_bound_bytes'] / 2**20:.1f} MiB (needed, not held); reshard also "
        f"copies {x['copied_locally_bytes'] / 2**20:.1f} MiB it holds into its fresh "
        f"outputs; {'same bits' if x['same_bits'] else 'BITS DIFFER'}"
    )
    return "\n".join(lines)


def _transformers_tp(path: str, prompt: list[int], tp: int) -> Callable[[int, int], Any]:
    """transformers' ``run(b, n)`` with its own tensor parallelism over the world (already initialized)."""
    import transformers as T
    from transformers.distributed import DistributedConfig

    model = T.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp)
    ).eval()
    sharded_q = model.model.layers[0].self_attn.q_proj.weight
    if not hasattr(sharded_q, "to_local") or sharded_q.to_local().shape[0] * tp != sharded_q.shape[0]:
        raise RuntimeError(f"transformers did not shard q_proj over {tp} ranks; its tp plan was not applied")
    ids = torch.tensor([prompt])

    def run(b: int, n: int) -> Any:
        with torch.no_grad():
            return model.generate(
                ids.expand(b, -1), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None
            )

    return run


def _between_barriers(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn()`` up to the barrier after it, started at a barrier: the slowest rank counts."""
    dist.barrier()
    return seconds(lambda: (fn(), dist.barrier()))


def _plain(layout: Layout, n: int, name: str) -> Layout:
    """A tensor's slice of a fused leaf as the plain shard it is (one block cut evenly: DTensor's ``Shard``)."""
    dims = []
    for spec in layout.dims:
        if isinstance(spec, Shard) and spec.blocks:
            (block,) = spec.blocks
            if (block.size // block.unit) % n or spec.pack != 1 or spec.groups != 1:
                raise ValueError(f"bench peers: {name}'s slice {spec} is no plain shard over {n} ranks")
            spec = Shard(spec.axes)
        dims.append(spec)
    return Layout(tuple(dims))


def _settled(x: torch.Tensor) -> torch.Tensor:
    wait = getattr(x, "wait", None)
    return wait() if callable(wait) else x
