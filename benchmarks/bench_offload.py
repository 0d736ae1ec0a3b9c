"""What keeping weight series in host memory costs on this host: decode tokens/s with o_proj and down_proj in host
memory at prefetch steps 0, 1 and 2, against the resident model; and, with ``--link``, the exposed copy time against
``k`` on an emulated host link.

    python -m benchmarks offload [--quick] [--repeat N] [--link [--latency-us U]] [--json FILE [--append]]

One process, one rank, float32, compiled with inductor: the benchmarks' 70.5M-parameter Qwen3-style model
(:data:`benchmarks.configs.FULL`, 12 layers; ``--quick``: :data:`~benchmarks.configs.QUICK`, 4 layers) with seeded
weights, resident (``Plan()``) and with ``Plan(offload="o_proj,down_proj", prefetch_step=k)``. Every offloaded model's
greedy tokens are checked equal to the resident model's before timing. Systems, each timed once per round, rounds
interleaved: ``b{1,8}_resident`` and ``b{1,8}_offload_k{0,1,2}``, ``B (N - 1) / (T(N) - T(1))`` decode tokens/s
(N = 16 new tokens). Reported: medians and spread, and each round's resident / offloaded ratio.

On a CPU host the "host link" is a memcpy on the cores that compute (no copy engine, one memory): every layer's copy
is exposed whatever ``k`` is, and that figure is the copy's price on this host. ``--link`` adds a device's link: each
host copy is delivered through an :class:`~functional_npu.parallel.host_link.EmulatedHostLink` (serialized transfers
of ``latency + bytes / rate`` each, completed on the link's thread while the step computes), its rate set as the
emulated interconnect's is, to one layer's host bytes over one layer's compute (the resident model's decode step over
``L``), its latency stated (default 10 us). At batch 1, systems ``offload_k{0,1,2}`` (the memcpy alone) and
``link_k{0,1,2}`` (the same models on the link), interleaved with ``resident``; per round, the exposed link time per
decode step ``1 / rate(link_k) - 1 / rate(offload_k)`` and its fraction of the link's whole time per step
(``L (latency + bytes / rate)``), against the fraction the cost model predicts
(:func:`functional_npu.parallel.prefetch_cost.exposed`) from the resident model's per-layer compute (a transfer starts
once its memcpy is done, so only the layers' own compute hides it) and the link's transfer time, alone and with the
link's measured lateness (its thread's wake-up on a core the step is using, counted per transfer) added to it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from functional_npu import Mesh, Plan, compile_model
from functional_npu.models import family_of
from functional_npu.parallel import EmulatedHostLink, exposed
from functional_npu.placement import place

from .configs import FULL, QUICK
from .flags import count, non_negative
from .timing import rates, ratio, rounds, stats

__all__ = ["main", "measure", "measure_link"]

NEW = 16
PROMPT = 8
BATCHES = (1, 8)
STEPS = (0, 1, 2)
SERIES = "o_proj,down_proj"


def _decoder(cfg: Any, plan: Plan, batch: int, link: EmulatedHostLink | None = None):
    """A compiled model of ``cfg`` under ``plan`` (its host series split off the seeded full params), its host
    copies delivered through ``link`` if given, and its run."""
    from functional_npu.parallel import stack_host

    mesh = Mesh.abstract({"tp": 1}, 0)
    placed = place(cfg, mesh, plan)
    params = family_of(cfg).init_params(cfg, seed=0)
    if placed.plan.offload:
        params = stack_host(params, placed.plan.offload)
    model = compile_model(
        params.placed(placed), mesh, backend="inductor", batch_sizes=[batch],
        max_seq_len=PROMPT + NEW + 8, prefill_lengths=[PROMPT], host_link=link,
    )  # fmt: skip
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(PROMPT)] for i in range(batch)]

    def run(b: int, new: int) -> Any:
        return model.generate(prompts[:b], new)

    return run


def measure(cfg: Any, repeat: int) -> dict[str, Any]:
    """Build (compile, warm, check tokens) every system, then ``repeat`` interleaved rounds."""
    systems, built, ratios = {}, {}, {}
    plans = {"resident": Plan()} | {f"offload_k{k}": Plan(offload=SERIES, prefetch_step=k) for k in STEPS}
    for b in BATCHES:
        reference = None
        for tag, plan in plans.items():
            t = time.perf_counter()
            run = _decoder(cfg, plan, b)
            tokens = run(b, NEW)
            if reference is None:
                reference = tokens
            elif tokens != reference:
                raise AssertionError(f"{tag} at batch {b}: tokens differ from the resident model's")
            rates(run, b, NEW, PROMPT)
            built[f"b{b}_{tag}"] = time.perf_counter() - t
            systems[f"b{b}_{tag}"] = lambda run=run, b=b: rates(run, b, NEW, PROMPT)[0]
    got = rounds(systems, repeat, warmup=1)
    for b in BATCHES:
        for k in STEPS:
            ratios[f"b{b}_resident_over_offload_k{k}"] = ratio(got[f"b{b}_resident"], got[f"b{b}_offload_k{k}"])
    return {"build_s": built, "systems": {n: stats(v) for n, v in got.items()}, "ratios": ratios, "tokens_equal": True}


def _layer_host_bytes(cfg: Any) -> int:
    """One layer's bytes of the offloaded series (what one ring write moves)."""
    from functional_npu.parallel import host_layer_bytes, stack_host

    params = stack_host(family_of(cfg).init_params(cfg, seed=0), place(cfg, Mesh.abstract({"tp": 1}, 0), Plan(
        offload=SERIES)).plan.offload)  # fmt: skip
    return host_layer_bytes(params)


def measure_link(cfg: Any, repeat: int, latency_s: float) -> dict[str, Any]:
    """The ``--link`` measurement (module docstring): build the resident model, set the link's rate from its decode
    step, build the offloaded models with and without the link (tokens checked), then ``repeat`` rounds."""
    import contextlib

    L, b = cfg.num_layers, 1
    reference_run = _decoder(cfg, Plan(), b)
    reference = reference_run(b, NEW)
    rates(reference_run, b, NEW, PROMPT)  # untimed: the first steps after compiling run slow
    step = sorted(1 / rates(reference_run, b, NEW, PROMPT)[0] for _ in range(3))[1]
    layer_bytes = _layer_host_bytes(cfg)
    rate = layer_bytes / (step / L)  # one layer's host bytes in one layer's compute
    systems: dict[str, Any] = {"resident": lambda: rates(reference_run, b, NEW, PROMPT)[0]}
    links: dict[int, EmulatedHostLink] = {}
    with contextlib.ExitStack() as stack:
        for k in STEPS:
            links[k] = stack.enter_context(EmulatedHostLink(rate, latency_s))
            for tag, link in ((f"offload_k{k}", None), (f"link_k{k}", links[k])):
                run = _decoder(cfg, Plan(offload=SERIES, prefetch_step=k), b, link)
                if run(b, NEW) != reference:
                    raise AssertionError(f"{tag}: tokens differ from the resident model's")
                rates(run, b, NEW, PROMPT)
                systems[tag] = lambda run=run: rates(run, b, NEW, PROMPT)[0]
        got = rounds(systems, repeat, warmup=1)
        carried = {k: dict(link.carried) for k, link in links.items()}
    transfer = latency_s + layer_bytes / rate  # the link's time for one layer
    out: dict[str, Any] = {
        "rows": [], "layers": L, "per_layer_bytes": layer_bytes, "rate_bytes_per_s": rate, "latency_s": latency_s,
        "per_layer_transfer_s": transfer, "resident_step_s": step, "systems": {n: stats(v) for n, v in got.items()},
        "carried": carried, "tokens_equal": True,
    }  # fmt: skip
    # a copy's transfer starts once its memcpy is done, so what hides it is the layers' own compute: the resident's
    compute = statistics.median(1 / r for r in got["resident"]) / L
    for k in STEPS:
        plain, linked = got[f"offload_k{k}"], got[f"link_k{k}"]
        exposed_s = [1 / lk - 1 / p for lk, p in zip(linked, plain)]  # per decode step, round by round
        late = carried[k]["late_s"] / max(carried[k]["transfers"], 1)  # the link thread's wake-up, per transfer
        out["rows"].append({
            "k": k, "exposed_s": stats(exposed_s), "fraction": stats([e / (L * transfer) for e in exposed_s]),
            "predicted_fraction": exposed(L, k, compute, transfer, transfer),
            "predicted_with_lateness": exposed(L, k, compute, transfer + late, transfer + late) * (transfer + late)
            / transfer, "per_layer_compute_s": compute, "late_s_per_transfer": late,
        })  # fmt: skip
    return out


def link_table(result: dict[str, Any]) -> str:
    rows = [
        f"link: {result['rate_bytes_per_s'] / 1e9:.3f} GB/s, latency {result['latency_s'] * 1e6:.0f} us; one layer "
        f"({result['per_layer_bytes'] / 2**20:.2f} MiB) takes {result['per_layer_transfer_s'] * 1e3:.2f} ms, "
        f"{result['layers']} layers {result['layers'] * result['per_layer_transfer_s'] * 1e3:.1f} ms per step; "
        f"resident decode step {result['resident_step_s'] * 1e3:.1f} ms; the link's completions came "
        + ", ".join(f"{c['late_s'] / max(c['transfers'], 1) * 1e6:.0f}" for c in result["carried"].values())
        + " us late on average (k = "
        + ", ".join(str(k) for k in result["carried"])
        + ")",
        "| k | exposed link ms per step (spread) | exposed fraction | predicted | predicted, lateness added |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        e, f = r["exposed_s"], r["fraction"]
        rows.append(
            f"| {r['k']} | {e['median'] * 1e3:.2f} ({e['min'] * 1e3:.2f} to {e['max'] * 1e3:.2f}) | {f['median']:.2f} "
            f"({f['min']:.2f} to {f['max']:.2f}) | {r['predicted_fraction']:.2f} | {r['predicted_with_lateness']:.2f} |"
        )
    return "\n".join(rows)


def table(result: dict[str, Any]) -> str:
    s, r = result["systems"], result["ratios"]
    rows = ["| batch | resident tok/s | " + " | ".join(f"offload k={k}: tok/s (cost)" for k in STEPS) + " |"]
    rows.append("|---" * (2 + len(STEPS)) + "|")
    for b in BATCHES:
        res = s[f"b{b}_resident"]
        cols = []
        for k in STEPS:
            o, c = s[f"b{b}_offload_k{k}"], r[f"b{b}_resident_over_offload_k{k}"]
            cols.append(f"{o['median']:.1f} ({c['median']:.2f}x, {c['min']:.2f}-{c['max']:.2f})")
        rows.append(f"| {b} | {res['median']:.1f} ({res['min']:.1f}-{res['max']:.1f}) | " + " | ".join(cols) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks offload", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the 4-layer model")
    p.add_argument("--repeat", type=count, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--json", metavar="FILE", help="write the result here")
    p.add_argument("--append", action="store_true", help="add this run to the JSON's runs")
    p.add_argument("--link", action="store_true", help="the exposed copy time against k on an emulated host link")
    p.add_argument("--latency-us", type=non_negative, default=10.0, help="the emulated link's latency (default 10 us)")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.link:
        result = measure_link(cfg, args.repeat, args.latency_us * 1e-6)
        print(link_table(result))
    else:
        result = measure(cfg, args.repeat)
        print(table(result))
    result |= {"model": "QUICK" if args.quick else "FULL", "series": SERIES, "host": platform.node()}
    if args.json:
        path = Path(args.json)
        runs = json.loads(path.read_text())["runs"] if args.append and path.exists() else []
        flags = (" --quick" if args.quick else "") + (f" --link --latency-us {args.latency_us:g}" if args.link else "")
        command = "python -m benchmarks offload --json " + args.json + flags
        path.write_text(json.dumps({"command": command, "runs": runs + [result]}, indent=1) + "\n")
    return 0
