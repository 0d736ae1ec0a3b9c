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

from functional_npu.core import (
    Layout,
    Shard,
    flatten_with_paths,
    placements_of,
    plan_reshard,
    reshard,
    shard,
    sharded,
    to_dtensor,
)
from functional_npu.models import family_of
from functional_npu.placement import check_plan, stored_tensors
from functional_npu.runtime import RankContext
from functional_npu.runtime.loading import load_checkpoint
from functional_npu.runtime.serving import cache_length, compile_model

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


# each row of the decode peer: (this library's system, transformers' system), timed in the same rounds
PAIRS = {"compiled": ("fnpu_compiled_tp", "hf_tp_compiled"), "eager": ("fnpu_eager_tp", "hf_tp_eager")}
# what each side computes per decode step (the same work on both)
LOGITS = (
    "full logits at the last position, then argmax, on both: transformers' generate (logits_to_keep=1) and this "
    "library without its greedy head (the vocab-parallel head's logits all-gathered over tp)"
)


def decode_tp_peer(
    ctx: RankContext, path: str, prompt: list[int], new: int, repeat: int, *, compiled: bool = True
) -> dict[str, Any]:
    """Rank job: decode at tp = world on the checkpoint at ``path``, this library against transformers' tp plan,
    compiled against compiled (ours: inductor; theirs: ``generate`` with a static cache and ``torch.compile``,
    fullgraph) and eager against eager (ours: the plain forward, ``backend="none"``), every system in the same
    interleaved rounds. ``{"fnpu": ..., "peer": ...}``: ``fnpu`` this library's compiled rates and first-call time
    (the eager ones if not ``compiled``); ``peer`` every system's rates, each row's ratio per round, whether every
    system gives the same greedy tokens, and ``compiled_error`` if transformers could not compile."""
    mesh = ctx.mesh({"tp": ctx.world_size})
    systems: dict[str, Callable[[int, int], Any]] = {}
    first: dict[str, float] = {}
    if compiled:
        systems["fnpu_compiled_tp"], first["fnpu_compiled_tp"] = _warmed(
            lambda: fnpu_runner(path, mesh, prompt, new)[0], new
        )
    systems["fnpu_eager_tp"] = _fnpu_eager(path, mesh, prompt, new)
    ours = "fnpu_compiled_tp" if compiled else "fnpu_eager_tp"
    if importlib.util.find_spec("accelerate") is None:
        runs = {k: v[1] for k, v in interleaved({ours: systems[ours]}, (1,), new, len(prompt), repeat).items()}
        return {
            "fnpu": _rates(runs[ours]) | {"compile_s": first.get(ours)},
            "peer": {"skipped": "transformers loads a tp plan only with accelerate (pip install accelerate)"},
        }
    systems["hf_tp_eager"] = _transformers_tp(path, prompt, ctx.world_size)
    error = None
    if compiled:
        try:
            systems["hf_tp_compiled"], first["hf_tp_compiled"] = _warmed(
                lambda: _transformers_tp(path, prompt, ctx.world_size, compiled=True), new, traced=True
            )
        except Exception as e:  # noqa: BLE001 - any failure to compile is reported, and the eager rows still run
            error = f"{type(e).__name__}: {e}"[:2000]
    tokens = {name: [[int(t) for t in row] for row in run(1, new)] for name, run in systems.items()}
    runs = {k: v[1] for k, v in interleaved(systems, (1,), new, len(prompt), repeat).items()}
    peer = {
        "tp": ctx.world_size,
        "same_tokens": all(t == tokens[ours] for t in tokens.values()),
        "logits": LOGITS,
        "decode_tok_s": {k: stats(v["decode"]) for k, v in runs.items()},
        "prefill_tok_s": {k: stats(v["prefill"]) for k, v in runs.items()},
        "compile_s": first,
        "decode_ratio": {
            row: ratio(runs[a]["decode"], runs[b]["decode"]) for row, (a, b) in PAIRS.items() if a in runs and b in runs
        },
    }
    if error is not None:
        peer["compiled_error"] = error
    return {"fnpu": _rates(runs[ours]) | {"compile_s": first.get(ours)}, "peer": peer}


def _rates(run: dict[str, list[float]]) -> dict[str, list[float]]:
    return {"decode": run["decode"], "prefill": run["prefill"]}


def _warmed(build: Callable[[], Callable[[int, int], Any]], new: int, traced: bool = False) -> tuple[Any, float]:
    """(``build()``'s run, warmed on ``new`` and on 1 new token; seconds to build and warm it). ``traced``: raise
    if no graph was traced on the way (a compile setting ignored would leave the run eager)."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    run = build()
    run(1, new)
    run(1, 1)
    seconds_ = time.perf_counter() - t0
    if traced and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs:
        raise RuntimeError("generate traced no graph: transformers ran it eagerly despite its compile config")
    return run, seconds_


def _fnpu_eager(path: str, mesh: Any, prompt: list[int], new: int) -> Callable[[int, int], Any]:
    """This library's plain forward (``backend="none"``: no ``torch.compile``) on ``mesh``: ``run(b, n)``."""
    model = compile_model(
        load_checkpoint(path, mesh),
        mesh,
        backend="none",
        batch_sizes=[1],
        max_seq_len=cache_length(len(prompt) + new),
    )
    return lambda b, n: model.generate([prompt] * b, n)


def peers_report(peers: dict[str, Any]) -> str:
    """The peers as printed lines (medians, spread, ratio from the same rounds)."""
    lines = []
    d = peers["decode_tp"]
    if "skipped" in d:
        lines.append(f"decode at tp 2 against transformers' tp plan: skipped ({d['skipped']})")
    else:
        lines += _decode_lines(d)
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


def _decode_lines(d: dict[str, Any]) -> list[str]:
    """One line per row of the decode peer (compiled against compiled, eager against eager), then the tokens."""
    what = {
        "compiled": (
            "this library compiled (inductor)",
            "transformers' tp_plan='auto' generate, static cache + compile",
        ),
        "eager": ("this library eager (plain forward)", "transformers' tp_plan='auto' generate, eager"),
    }
    rates, lines = d["decode_tok_s"], []
    for row, (ours, theirs) in PAIRS.items():
        if row not in d["decode_ratio"]:
            if row == "compiled" and "compiled_error" in d:
                lines.append(f"decode at tp {d['tp']}, compiled: transformers could not compile: {d['compiled_error']}")
            continue
        r = d["decode_ratio"][row]
        lines.append(
            f"decode at tp {d['tp']}, {row} against {row}: {what[row][0]} {rates[ours]['median']:.1f} tok/s, "
            f"{what[row][1]} {rates[theirs]['median']:.1f} tok/s: {r['median']:.2f}x ({r['min']:.2f} to "
            f"{r['max']:.2f} over the rounds)"
        )
    lines.append(f"  tokens {'equal' if d['same_tokens'] else 'DIFFER'} across the systems; {d['logits']}")
    return lines


def _transformers_tp(path: str, prompt: list[int], tp: int, compiled: bool = False) -> Callable[[int, int], Any]:
    """transformers' ``run(b, n)`` (the new tokens of each row, as lists) with its own tensor parallelism over the
    world (already initialized); ``compiled``: ``generate`` with a static cache and ``torch.compile`` (fullgraph, on
    every device: transformers compiles on CUDA only unless told), as the scoreboard runs it on one rank."""
    import transformers as T
    from transformers.distributed import DistributedConfig

    model = T.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp)
    ).eval()
    sharded_q = model.model.layers[0].self_attn.q_proj.weight
    if not hasattr(sharded_q, "to_local") or sharded_q.to_local().shape[0] * tp != sharded_q.shape[0]:
        raise RuntimeError(f"transformers did not shard q_proj over {tp} ranks; its tp plan was not applied")
    if compiled:
        cc = T.CompileConfig(fullgraph=True)
        cc._compile_all_devices = True
        model.generation_config.compile_config = cc
        model.generation_config.cache_implementation = "static"
    ids = torch.tensor([prompt])

    def run(b: int, n: int) -> Any:
        with torch.no_grad():
            out = model.generate(
                ids.expand(b, -1), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None
            )
        return out[:, len(prompt) :].tolist()

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
