"""Decode tokens/s by weight format: fp32, bf16, int8 and int4 of the same model, against the roofline at
each format's own bytes per token and against the peer a CPU user would pick.

The weights are one seeded model written four ways: fp32, bf16, and compressed-tensors int8 (per channel,
weight-only) and int4 (groups of 128, weight-only) quantized from the bf16 one, every linear layer
including ``lm_head`` (as torchao's ``quantize_`` does). Peers: transformers at the same dtype with
``generate`` compiled (static cache); for int8 / int4, transformers with torchao's weight-only
quantization, compiled, when torchao is installed and runs on this CPU (else the reason is recorded).
Every system is compiled with inductor's C++ wrapper (``mode="reduce-overhead"`` here; the peers get the
same ``cpp_wrapper`` option).

Fair timing on a shared machine (:mod:`benchmarks.timing`): the process is pinned to its cores, every system is
built and warmed first, then each round runs every system once in turn (A B C A B C ...), and each figure is the
median over rounds with its spread (min, max). Decode tokens/s at batch ``b`` are
``b (N - 1) / (T(N new tokens) - T(1 new token))``, the scoreboard's formula. The roofline is the
same-run matrix-vector bandwidth (fp32, a weight larger than the caches) over the weight bytes one decode
step reads (every weight but the embedding table, of which one row per token), times the batch.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from functional_npu.core import Mesh, Quant, flatten_with_paths, map_with_path
from functional_npu.models.llama import LlamaConfig, init_params
from functional_npu.placement import QuantConfig
from functional_npu.runtime.loading import load_checkpoint, save_checkpoint
from functional_npu.runtime.serving import CompiledModel, cache_length, compile_model

from .roofline import step_cost, step_floor
from .timing import best_time, interleaved, pin_threads, ratio, read_bandwidth, stats

__all__ = [
    "FORMATS",
    "run_formats",
    "cells",
    "targets",
    "targets_table",
    "peers_of",
    "format_table",
    "formats_plot",
    "decode_bytes",
    "checkpoints",
    "pyplot",
    "fnpu_runner",
    "transformers_runner",
    "hf_runner",
    "compile_ratio",
    "compiled_graphs",
]

# format -> (activation / float dtype, quantization of every linear layer or None)
FORMATS: dict[str, tuple[torch.dtype, Quant | None]] = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "int8": (torch.bfloat16, Quant(8, "channel")),
    "int4": (torch.bfloat16, Quant(4, "group", group_size=128)),
}
BATCHES = (1, 8, 32)
PROMPT = 32
# transformers' compiled generate with each of inductor's wrappers; its figure in a round is the faster of the two
WRAPPERS = {"cpp": {"mode": None, "options": {"cpp_wrapper": True}}, "py": {}}
CPP_WRAPPER = WRAPPERS["cpp"]  # torchao's compile
PEAK_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16, "int4": torch.bfloat16}


def write_formats(
    cfg: LlamaConfig, root: Path, seed: int = 0, formats: tuple[str, ...] = tuple(FORMATS)
) -> dict[str, Path]:
    """The same seeded model as one HF directory per format (of ``formats``; int8 and int4 are quantized from bf16)."""
    full = init_params(cfg, seed=seed)
    out = {}
    for name, (dtype, quant) in ((f, FORMATS[f]) for f in formats):
        params = map_with_path(lambda p, x, dt=dtype: x.to(dt) if x.is_floating_point() else x, full)
        out[name] = save_checkpoint(params, root / name, quant=QuantConfig.of(quant, ()) if quant else None)
    return out


def checkpoints(formats: tuple[str, ...]) -> tuple[str, ...]:
    """The checkpoints a run of ``formats`` reads: each format's, and bf16's where int8 or int4 runs (torchao's peer
    quantizes the bf16 model)."""
    peer = ("bf16",) if any(f in ("int8", "int4") for f in formats) else ()
    return tuple(f for f in FORMATS if f in formats or f in peer)


def decode_bytes(params: dict[str, Any]) -> int:
    """Weight bytes one decode token reads from (prepared) params: all but the embedding, plus one of its rows."""
    total = sum(x.numel() * x.element_size() for p, x in flatten_with_paths(params) if p != "embed")
    embed = params["embed"]
    return total + embed.shape[-1] * embed.element_size()


def fnpu_runner(
    path: str | Path,
    mesh: Mesh,
    prompt: list[int],
    max_new: int,
    *,
    batch_sizes: tuple[int, ...] = (1,),
    mode: str | None = None,
    greedy_head: bool = False,
    device: str = "cpu",
) -> tuple[Callable[[int, int], Any], CompiledModel]:
    """This library's compiled model of the checkpoint at ``path`` on ``mesh`` (its params on ``device``), and
    ``run(b, n)``: ``n`` new tokens for ``b`` copies of ``prompt`` (``greedy_head``: decode steps through the argmax
    head, as the CLI runs greedy generation)."""
    model: CompiledModel = compile_model(
        load_checkpoint(path, mesh, device=device),
        mesh,
        mode=mode,
        batch_sizes=list(batch_sizes),
        max_seq_len=cache_length(len(prompt) + max_new),
        greedy_head=greedy_head,
    )
    return (lambda b, n: model.generate([prompt] * b, n)), model


def transformers_runner(
    path: str | Path,
    prompt: list[int],
    dtype: torch.dtype = torch.float32,
    *,
    compile_config: dict[str, Any] | None = None,
    quantize: Callable[[Any], Any] | None = None,
    device: str = "cpu",
) -> Callable[[int, int], Any]:
    """transformers' ``run(b, n)`` on the checkpoint at ``path`` in ``dtype`` on ``device``: ``generate`` eager, or
    compiled with a static cache when ``compile_config`` (``CompileConfig`` arguments besides ``fullgraph``) is
    given; ``quantize(model)`` first, if given."""
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    if quantize is not None:
        quantize(model)
    return hf_runner(model, prompt, compile_config=compile_config, device=device)


def hf_runner(
    model: Any, prompt: list[int], *, compile_config: dict[str, Any] | None = None, device: str = "cpu"
) -> Callable[[int, int], Any]:
    """``run(b, n)`` of a transformers model: ``generate`` eager, or compiled with a static cache when
    ``compile_config`` (``CompileConfig`` arguments besides ``fullgraph``) is given."""
    import transformers as T

    if compile_config is not None:
        cc = T.CompileConfig(fullgraph=True, **compile_config)
        cc._compile_all_devices = True  # transformers compiles generate on CUDA only unless told
        model.generation_config.compile_config = cc
        model.generation_config.cache_implementation = "static"
    ids = torch.tensor([prompt], device=device)

    def run(b: int, n: int) -> Any:
        with torch.no_grad():
            return model.generate(ids.expand(b, -1), max_new_tokens=n, min_new_tokens=n, do_sample=False)

    return run


def _torchao(bits: int) -> tuple[Callable[[Any], Any] | None, str | None]:
    """torchao's weight-only quantization of every linear layer, or None and why it cannot run here."""
    if importlib.util.find_spec("torchao") is None:
        return None, "torchao is not installed (pip install torchao to add this peer)"
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        config = Int8WeightOnlyConfig() if bits == 8 else Int4WeightOnlyConfig(group_size=128)
        probe = torch.nn.Linear(256, 256, dtype=torch.bfloat16)
        quantize_(probe, config)
        probe(torch.randn(1, 256, dtype=torch.bfloat16))
    except Exception as e:  # noqa: BLE001 - torchao raises anything from ImportError to AssertionError
        return None, f"torchao int{bits} weight-only does not run on this CPU: {type(e).__name__}: {e}"
    return (lambda model: quantize_(model, config)), None


# the targets: at batch 1 the share of the read roofline per format (memory binds there); at 8 and 32 the share of the
# memory-and-compute roofline; against transformers compiled (the faster wrapper) and torchao in every cell
SHARE_TARGETS = {
    "1": {"fp32": 0.80, "bf16": 0.75, "int8": 0.60, "int4": 0.45},
    "8": dict.fromkeys(FORMATS, 0.50),
    "32": dict.fromkeys(FORMATS, 0.50),
}
PEER_TARGET = 1.2  # against transformers compiled (fp32, bf16) and torchao (int8), in every cell
FIXED_TARGET_MS = 1.0  # a batch-1 decode step minus its floor (weight bytes over the read bandwidth)


def peers_of(fmt: str) -> list[str]:
    """The peer of a format's cells: transformers compiled at its dtype (the faster of its two wrappers in each
    round); torchao for int8 / int4."""
    return {"fp32": ["hf_fp32"], "bf16": ["hf_bf16"], "int8": ["torchao_int8"], "int4": ["torchao_int4"]}[fmt]


def faster_wrapper(decode: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, list[float]]]:
    """``decode`` with ``hf_<fmt>``: in each round and batch the faster of ``hf_<fmt>_cpp`` and ``hf_<fmt>_py``."""
    out = dict(decode)
    for fmt in ("fp32", "bf16"):
        built = [d for d in (decode.get(f"hf_{fmt}_{w}") for w in WRAPPERS) if d]  # one, where one wrapper ran
        if built:
            out[f"hf_{fmt}"] = {b: [max(xs) for xs in zip(*(d[b] for d in built))] for b in built[0]}
    return out


def gemm_peak(dtype: torch.dtype, n: int = 2048, repeat: int = 3) -> float:
    """FLOP/s of an ``n``-cubed matrix product of random ``dtype`` operands (three 16 MiB float32 matrices at the
    default: larger than the caches), the fastest of ``repeat``: the machine's compute peak as torch reaches it."""
    a, b = (torch.randn(n, n, dtype=dtype) for _ in range(2))
    a @ b
    return 2 * n**3 / best_time(lambda: a @ b, repeat)


def run_formats(
    cfg: LlamaConfig,
    root: Path,
    *,
    new: int = 32,
    repeat: int = 5,
    threads: int | None = None,
    formats: tuple[str, ...] = tuple(FORMATS),
    wrappers: tuple[str, ...] = tuple(WRAPPERS),
    log=print,
) -> dict[str, Any]:
    """Build every system on ``cfg``'s weights (written under ``root``), then ``repeat`` interleaved rounds with the
    read bandwidth and the fp32 and bf16 matmul peaks sampled before the first and after every round; returns one
    run's JSON-ready result (every round's figures, and each cell's shares and ratios taken round by round,
    :func:`cells`)."""
    # transformers' models of every format and wrapper share one forward, compiled once per batch size each: more
    # graphs of one code object than dynamo's default limit of 8 (fullgraph=True then fails)
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024):
        return _run_formats(cfg, root, new, repeat, threads, formats, wrappers, log)


def _run_formats(
    cfg: LlamaConfig,
    root: Path,
    new: int,
    repeat: int,
    threads: int | None,
    formats: tuple[str, ...],
    wrappers: tuple[str, ...],
    log: Any,
) -> dict[str, Any]:
    cores = pin_threads(threads)
    prompt = [(7 * i) % cfg.vocab_size for i in range(1, PROMPT + 1)]
    paths = write_formats(cfg, root, formats=checkpoints(formats))
    systems: dict[str, Callable[[int, int], Any]] = {}
    bytes_per_token, skipped, cost = {}, {}, {}
    mesh = Mesh.abstract({"tp": 1}, 0)
    for name in formats:
        # the default configuration: compile_model picks the mode and the kernels per device, no flag
        systems[f"fnpu_{name}"], model = fnpu_runner(paths[name], mesh, prompt, new, batch_sizes=BATCHES)
        bytes_per_token[name] = decode_bytes(model.params)
        kv = FORMATS[name][0].itemsize
        cost[name] = {str(b): step_cost(cfg, bytes_per_token[name], kv, b, PROMPT, new) for b in BATCHES}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for name in (f for f in formats if f in dtypes):
        for wrapper, config in ((w, WRAPPERS[w]) for w in wrappers):
            hf = transformers_runner(paths[name], prompt, dtypes[name], compile_config=config)
            systems[f"hf_{name}_{wrapper}"] = hf
    for bits in (8, 4):
        if f"int{bits}" not in formats:
            continue
        quantize, why = _torchao(bits)
        if quantize is None:
            skipped[f"torchao_int{bits}"] = why
        else:
            systems[f"torchao_int{bits}"] = transformers_runner(
                paths["bf16"], prompt, torch.bfloat16, compile_config=CPP_WRAPPER, quantize=quantize
            )
    compile_s, graphs = {}, {}
    for name, run in systems.items():  # compile and warm every shape before any timing; the first calls timed
        t0, before = time.perf_counter(), compiled_graphs()
        for b in BATCHES:
            run(b, new)
            run(b, 1)
        compile_s[name], graphs[name] = time.perf_counter() - t0, compiled_graphs() - before
        log(f"  decode: {name} built ({compile_s[name]:.0f} s to compile and warm, {graphs[name]} graphs)", flush=True)
    read = [read_bandwidth()]
    peaks = {"fp32": [gemm_peak(torch.float32)], "bf16": [gemm_peak(torch.bfloat16)]}

    def between(r: int) -> None:
        read.append(read_bandwidth())
        for k, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            peaks[k].append(gemm_peak(dt))
        log(
            f"  decode: round {r + 1}/{repeat} done ({read[-1] / 1e9:.1f} GB/s read, matmul "
            f"{peaks['fp32'][-1] / 1e9:.0f} / {peaks['bf16'][-1] / 1e9:.0f} GFLOP/s fp32 / bf16)",
            flush=True,
        )

    runs = interleaved(systems, BATCHES, new, len(prompt), repeat, between)
    decode = faster_wrapper({s: {str(b): v["decode"] for b, v in per.items()} for s, per in runs.items()})
    # round r lies between samples r and r + 1: its roofline is their mean
    mid = lambda xs: [(a + b) / 2 for a, b in zip(xs, xs[1:])]  # noqa: E731
    round_read = mid(read)
    round_peak = {f: mid(peaks["fp32" if PEAK_DTYPE[f] == torch.float32 else "bf16"]) for f in formats}
    return {
        "systems": {name: {b: stats(v) for b, v in per.items()} for name, per in decode.items()},
        "decode_runs": decode,
        "bytes_per_token": bytes_per_token,
        "step_cost": cost,
        "read_gb_s": stats([x / 1e9 for x in read]),
        "round_read_gb_s": [x / 1e9 for x in round_read],
        "gemm_gflop_s": {k: stats([x / 1e9 for x in v]) for k, v in peaks.items()},
        "skipped": skipped,
        "compile_s": compile_s,
        "compiled_graphs": graphs,
        "cells": cells(decode, cost, round_read, round_peak),
        "settings": {
            "cores": cores,
            "threads": torch.get_num_threads(),
            "new_tokens": new,
            "prompt": len(prompt),
            "rounds": repeat,
            "batches": list(BATCHES),
            "formats": {k: repr(q) if q else str(dt).removeprefix("torch.") for k, (dt, q) in FORMATS.items()},
            "compile": "ours: compile_model's default for the device (no flag); transformers: generate compiled with "
            "a static cache, with inductor's "
            + " and ".join({"cpp": "cpp_wrapper", "py": "Python wrapper"}[w] for w in wrappers)
            + " (its figure in a round: the faster); torchao: the same with the cpp_wrapper",
            "wrappers": list(wrappers),
            "peak": {f: str(PEAK_DTYPE[f]).removeprefix("torch.") for f in formats},
        },
    }


def cells(
    decode: dict[str, dict[str, list[float]]],
    cost: dict[str, dict[str, tuple[float, float]]],
    read: list[float],
    peak: dict[str, list[float]],
) -> dict:
    """Each format and batch: our tok/s; the share of the roofline, ``b / max(bytes / read, FLOPs / peak)`` with that
    round's read bandwidth and matmul peak (the format's compute dtype), and the term that binds; at batch 1 the
    fixed cost per step (step time minus that floor, ms); and the ratio to the format's peer, each taken round by
    round (:func:`benchmarks.timing.ratio`); ``{fmt: {batch: {...}}}``."""
    out: dict[str, Any] = {}
    for fmt, per_batch in cost.items():
        out[fmt] = {}
        for b, ours in decode[f"fnpu_{fmt}"].items():
            nbytes, flops = per_batch[b]
            floors = [step_floor(nbytes, flops, r, p) for r, p in zip(read, peak[fmt])]
            roof = [int(b) / t for t, _ in floors]
            binds = sorted({why for _, why in floors})
            cell: dict[str, Any] = {
                "tok_s": stats(ours),
                "roofline_tok_s": stats(roof),
                "share_of_roofline": ratio(ours, roof),
                "binds": binds[0] if len(binds) == 1 else "both",
                "step_bytes": nbytes,
                "step_flops": flops,
                "peers": {p: ratio(ours, decode[p][b]) for p in peers_of(fmt) if p in decode},
            }
            if b == "1":
                cell["fixed_ms"] = stats([1e3 * (1 / t - floor) for t, (floor, _) in zip(ours, floors)])
            out[fmt][b] = cell
    return out


def measured_formats(runs: list[dict[str, Any]]) -> list[str]:
    """The formats (in :data:`FORMATS`' order) that any of ``runs`` measured."""
    return [f for f in FORMATS if any(f in r["cells"] for r in runs)]


def targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every target against every run's medians: ``[{target, figures (one per run), met}]``; a target is met when
    it is met in every run of its format (a headline is confirmed by a second run). A run of other formats
    (``--formats int8,int4`` appended to runs of bf16 and fp32) shows "-" in the rows of a format it did not run,
    and neither meets nor misses them; a cell or peer a run of the format did not measure is "not run", and
    missed."""
    rows = []

    def row(
        what: str, got: list[float | None], want: float, fmt: str = "{:.0%}", below: bool = False, *, of: str
    ) -> None:
        ran = [of in r["cells"] for r in runs]
        ok = any(ran) and all(g is not None and (g <= want if below else g >= want) for g, h in zip(got, ran) if h)
        figures = ["-" if not h else "not run" if g is None else fmt.format(g) for g, h in zip(got, ran)]
        rows.append({"target": what, "figures": figures, "values": got, "met": ok})

    def cell(r: dict[str, Any], fmt: str, b: str) -> dict[str, Any]:
        return r["cells"].get(fmt, {}).get(b, {})

    present = measured_formats(runs)  # a run of some formats: theirs only
    for b, by_fmt in SHARE_TARGETS.items():
        for fmt, want in ((f, w) for f, w in by_fmt.items() if f in present):
            got = [cell(r, fmt, b).get("share_of_roofline", {}).get("median") for r in runs]
            roof = "the read roofline" if b == "1" else "the memory-and-compute roofline"
            row(f"{fmt} at batch {b} >= {want:.0%} of {roof}", got, want, of=fmt)
    for fmt in present:
        for b in SHARE_TARGETS:
            for peer in peers_of(fmt):
                got = [cell(r, fmt, b).get("peers", {}).get(peer, {}).get("median") for r in runs]
                if any(g is not None for g in got):
                    row(f"{fmt} at batch {b} >= {PEER_TARGET:.1f}x {peer}", got, PEER_TARGET, "{:.2f}x", of=fmt)
    for fmt in present:
        got = [cell(r, fmt, "1").get("fixed_ms", {}).get("median") for r in runs]
        row(
            f"{fmt} fixed cost per batch-1 step <= {FIXED_TARGET_MS} ms",
            got,
            FIXED_TARGET_MS,
            "{:.2f} ms",
            True,
            of=fmt,
        )
    for fmt in (f for f in present if f in ("fp32", "bf16")):  # cold compile against the peer's default wrapper
        got = [compile_ratio(r, fmt) for r in runs]
        if any(g is not None for g in got):
            row(
                f"{fmt} cold compile <= transformers' (default wrapper), ours / theirs",
                got,
                1.0,
                "{:.2f}x",
                True,
                of=fmt,
            )
    return rows


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process so far (its ``unique_graphs`` counter)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def compile_ratio(run: dict[str, Any], fmt: str) -> float | None:
    """Our first calls' time (compile and warm, every batch) over transformers' with its default (Python) wrapper, in
    one run; None where either was not timed."""
    times = run.get("compile_s", {})
    ours, theirs = times.get(f"fnpu_{fmt}"), times.get(f"hf_{fmt}_py")
    return None if ours is None or theirs is None else ours / theirs


def format_table(runs: list[dict[str, Any]]) -> str:
    """The markdown decode table of one or more runs (each cell: median and spread over rounds, per run)."""
    lines = [
        "| format | batch | functional-npu tok/s | share of roofline (binds) | fixed ms/step | peer: ratio (min-max) |",
        "|---|---|---|---|---|---|",
    ]
    present = measured_formats(runs)  # runs of some formats: "not run" elsewhere
    for fmt in present:
        batches = next(r["cells"][fmt] for r in runs if fmt in r["cells"])
        for b in batches:
            per = [r["cells"].get(fmt, {}).get(b) for r in runs]
            got = [c for c in per if c is not None]

            def each(show: Callable[[dict[str, Any]], str], per: list = per) -> str:
                return " / ".join("not run" if c is None else show(c) for c in per)

            tok = each(lambda c: f"{c['tok_s']['median']:.1f} ({c['tok_s']['min']:.1f}-{c['tok_s']['max']:.1f})")
            share = each(lambda c: f"{c['share_of_roofline']['median']:.0%}") + f" ({got[0]['binds']})"
            fixed = each(lambda c: f"{c['fixed_ms']['median']:.2f}") if b == "1" else "-"
            names = list(dict.fromkeys(p for c in got for p in c["peers"]))  # a peer any run measured
            peers = "; ".join(
                f"{p} "
                + each(
                    lambda c, p=p: (
                        f"{c['peers'][p]['median']:.2f}x ({c['peers'][p]['min']:.2f}-{c['peers'][p]['max']:.2f})"
                        if p in c["peers"]
                        else "not run"
                    )
                )
                for p in names
            )
            lines.append(f"| {fmt} | {b} | {tok} | {share} | {fixed} | {peers or '-'} |")
    for i, r in enumerate(runs, 1):
        for name, why in r["skipped"].items():
            lines.append(f"\n{name}" + (f" (run {i})" if len(runs) > 1 else "") + f": {why}")
    return "\n".join(lines)


def targets_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`targets`."""
    runs = max((len(r["figures"]) for r in rows), default=2)
    lines = [f"| target | {' / '.join(f'run {i}' for i in range(1, runs + 1))} | |", "|---|---|---|"]
    lines += [f"| {r['target']} | {' / '.join(r['figures'])} | {'met' if r['met'] else 'missed'} |" for r in rows]
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def formats_plot(res: dict[str, Any], path: str, batch: str = "1") -> bool:
    """Decode tokens/s per format at ``batch`` in one run: ours and the first peer (median, spread as an error
    bar) and the read roofline at the format's bytes (PNG); False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fmts = list(res["cells"])
    peers = [next((p for p in peers_of(f) if p in res["systems"]), None) for f in fmts]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    x = range(len(fmts))
    for offset, names, color, label in (
        (-0.2, [f"fnpu_{f}" for f in fmts], "tab:blue", "functional-npu (default)"),
        (0.2, peers, "tab:gray", "peer"),
    ):
        got = [res["systems"].get(n, {}).get(batch) if n else None for n in names]
        meds = [s["median"] if s else 0.0 for s in got]
        err = [[s["median"] - s["min"] if s else 0.0 for s in got], [s["max"] - s["median"] if s else 0.0 for s in got]]
        ax.bar([i + offset for i in x], meds, 0.4, yerr=err, color=color, label=label, capsize=3)
    roofs = [res["cells"][f][batch]["roofline_tok_s"]["median"] for f in fmts]
    ax.scatter(x, roofs, marker="_", s=900, color="tab:red", label="read roofline at the format's bytes")
    ax.set_xticks(list(x), [f"{f}\n(peer: {p or 'none'})" for f, p in zip(fmts, peers)], fontsize=8)
    ax.set(ylabel=f"decode tokens/s (batch {batch})", title="Decode by weight format, median of interleaved rounds")
    ax.set_ylim(0, 1.25 * max(ax.get_ylim()[1], 1.0))
    ax.legend(fontsize=8, loc="upper left", ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
