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
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from functional_npu.core.mesh import Mesh
from functional_npu.core.quant import Quant
from functional_npu.core.tree import flatten_with_paths, map_with_path
from functional_npu.models.llama import LlamaConfig, init_params
from functional_npu.runtime.checkpoint import load_checkpoint
from functional_npu.runtime.compile import CompiledModel, cache_length, compile_model
from functional_npu.runtime.quant_config import QuantConfig
from functional_npu.runtime.save import save_checkpoint

from .timing import interleaved, matvec_bandwidth, pin_threads, stats

__all__ = [
    "FORMATS",
    "run_formats",
    "format_table",
    "formats_plot",
    "decode_bytes",
    "pyplot",
    "fnpu_runner",
    "transformers_runner",
]

# format -> (activation / float dtype, quantization of every linear layer or None)
FORMATS: dict[str, tuple[torch.dtype, Quant | None]] = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "int8": (torch.bfloat16, Quant(8, "channel")),
    "int4": (torch.bfloat16, Quant(4, "group", group_size=128)),
}
BATCHES = (1, 8)
CPP_WRAPPER = {"mode": None, "options": {"cpp_wrapper": True}}  # the peers' compile, as ours on CPU


def write_formats(cfg: LlamaConfig, root: Path, seed: int = 0) -> dict[str, Path]:
    """The same seeded model as one HF directory per format."""
    full = init_params(cfg, seed=seed)
    out = {}
    for name, (dtype, quant) in FORMATS.items():
        params = map_with_path(lambda p, x, dt=dtype: x.to(dt) if x.is_floating_point() else x, full)
        out[name] = save_checkpoint(params, root / name, quant=QuantConfig.of(quant, ()) if quant else None)
    return out


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
) -> tuple[Callable[[int, int], Any], CompiledModel]:
    """This library's compiled model of the checkpoint at ``path`` on ``mesh``, and ``run(b, n)``: ``n`` new
    tokens for ``b`` copies of ``prompt`` (``greedy_head``: decode steps through the argmax head, as the CLI
    runs greedy generation)."""
    model: CompiledModel = compile_model(
        load_checkpoint(path, mesh),
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
) -> Callable[[int, int], Any]:
    """transformers' ``run(b, n)`` on the checkpoint at ``path`` in ``dtype``: ``generate`` eager, or compiled with
    a static cache when ``compile_config`` (``CompileConfig`` arguments besides ``fullgraph``) is given;
    ``quantize(model)`` first, if given."""
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if quantize is not None:
        quantize(model)
    if compile_config is not None:
        cc = T.CompileConfig(fullgraph=True, **compile_config)
        cc._compile_all_devices = True  # transformers compiles generate on CUDA only unless told
        model.generation_config.compile_config = cc
        model.generation_config.cache_implementation = "static"
    ids = torch.tensor([prompt])

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


def run_formats(
    cfg: LlamaConfig, root: Path, *, new: int = 32, repeat: int = 3, threads: int | None = None, log=print
) -> dict[str, Any]:
    """Build every system on ``cfg``'s weights (written under ``root``), then ``repeat`` interleaved rounds;
    returns the JSON-ready ``formats`` result."""
    cores = pin_threads(threads)
    prompt = [(7 * i) % cfg.vocab_size for i in range(1, 33)]
    paths = write_formats(cfg, root)
    systems: dict[str, Callable[[int, int], Any]] = {}
    bytes_per_token, skipped = {}, {}
    mesh = Mesh.abstract({"tp": 1}, 0)
    for name in FORMATS:
        systems[f"fnpu_{name}"], model = fnpu_runner(
            paths[name], mesh, prompt, new, batch_sizes=BATCHES, mode="reduce-overhead"
        )
        bytes_per_token[name] = decode_bytes(model.params)
    systems["hf_fp32"] = transformers_runner(paths["fp32"], prompt, torch.float32, compile_config=CPP_WRAPPER)
    systems["hf_bf16"] = transformers_runner(paths["bf16"], prompt, torch.bfloat16, compile_config=CPP_WRAPPER)
    for bits in (8, 4):
        quantize, why = _torchao(bits)
        if quantize is None:
            skipped[f"torchao_int{bits}"] = why
        else:
            systems[f"torchao_int{bits}"] = transformers_runner(
                paths["bf16"], prompt, torch.bfloat16, compile_config=CPP_WRAPPER, quantize=quantize
            )
    for name, run in systems.items():  # compile and warm every shape before any timing
        for b in BATCHES:
            run(b, new)
            run(b, 1)
        log(f"  formats: {name} built", flush=True)
    bandwidth = [matvec_bandwidth()]

    def between(r: int) -> None:
        bandwidth.append(matvec_bandwidth())
        log(f"  formats: round {r + 1}/{repeat} done", flush=True)

    runs = interleaved(systems, BATCHES, new, len(prompt), repeat, between)
    decode = {s: {b: v["decode"] for b, v in per.items()} for s, per in runs.items()}
    bw = statistics.median(bandwidth)
    return _summary(decode, bytes_per_token, bw, bandwidth, skipped, cores, new, repeat)


def _peer(fmt: str) -> str:
    return {"fp32": "hf_fp32", "bf16": "hf_bf16", "int8": "torchao_int8", "int4": "torchao_int4"}[fmt]


def _summary(decode, bytes_per_token, bw, bandwidth, skipped, cores, new, repeat) -> dict[str, Any]:
    out: dict[str, Any] = {
        "systems": {name: {str(b): stats(v) for b, v in per.items()} for name, per in decode.items()},
        "bytes_per_token": bytes_per_token,
        "matvec_gb_s": stats([x / 1e9 for x in bandwidth]),
        "skipped": skipped,
        "settings": {
            "cores": cores,
            "threads": torch.get_num_threads(),
            "new_tokens": new,
            "prompt": 32,
            "rounds": repeat,
            "batches": list(BATCHES),
            "formats": {k: repr(q) if q else str(dt).removeprefix("torch.") for k, (dt, q) in FORMATS.items()},
            "compile": "inductor, cpp_wrapper (ours: mode='reduce-overhead'; transformers: CompileConfig options)",
        },
        "formats": {},
    }
    fp32 = {b: statistics.median(decode["fnpu_fp32"][b]) for b in BATCHES}
    for fmt in FORMATS:
        row = {}
        for b in BATCHES:
            ours = statistics.median(decode[f"fnpu_{fmt}"][b])
            roof = b * bw / bytes_per_token[fmt]
            peer = decode.get(_peer(fmt), {}).get(b)
            row[str(b)] = {
                "tok_s": ours,
                "roofline_tok_s": roof,
                "share_of_roofline": ours / roof,
                "vs_our_fp32": ours / fp32[b],
                "peer": _peer(fmt),
                "vs_peer": ours / statistics.median(peer) if peer else None,
            }
        out["formats"][fmt] = row
    return out


def format_table(res: dict[str, Any]) -> str:
    """The markdown table of a :func:`run_formats` result."""
    lines = [
        "| format | batch | fnpu tok/s (min-max) | share of roofline | vs our fp32 | peer "
        "| peer tok/s (min-max) | vs peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fmt, row in res["formats"].items():
        for b, r in row.items():
            ours = res["systems"][f"fnpu_{fmt}"][b]
            peer = res["systems"].get(r["peer"], {}).get(b)
            peer_s = f"{peer['median']:.1f} ({peer['min']:.1f}-{peer['max']:.1f})" if peer else "not run"
            vs = f"{r['vs_peer']:.2f}x" if r["vs_peer"] else "-"
            lines.append(
                f"| {fmt} | {b} | {r['tok_s']:.1f} ({ours['min']:.1f}-{ours['max']:.1f}) | "
                f"{r['share_of_roofline']:.0%} | {r['vs_our_fp32']:.2f}x | {r['peer']} | {peer_s} | {vs} |"
            )
    for name, why in res["skipped"].items():
        lines.append(f"\n{name}: {why}")
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
    """Decode tokens/s per format at ``batch``: ours (median, spread as an error bar), the peer, the roofline
    (PNG); False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fmts = list(res["formats"])
    fig, ax = plt.subplots(figsize=(7, 3.4))
    x = range(len(fmts))
    for offset, key, color, label in ((-0.2, "fnpu", "tab:blue", "functional-npu"), (0.2, "peer", "tab:gray", "peer")):
        meds, lo, hi = [], [], []
        for f in fmts:
            name = f"fnpu_{f}" if key == "fnpu" else res["formats"][f][batch]["peer"]
            s = res["systems"].get(name, {}).get(batch)
            meds.append(s["median"] if s else 0.0)
            lo.append(s["median"] - s["min"] if s else 0.0)
            hi.append(s["max"] - s["median"] if s else 0.0)
        ax.bar([i + offset for i in x], meds, 0.4, yerr=[lo, hi], color=color, label=label, capsize=3)
    ax.scatter(
        x,
        [res["formats"][f][batch]["roofline_tok_s"] for f in fmts],
        marker="_",
        s=900,
        color="tab:red",
        label="roofline at the format's bytes",
    )
    peers = [res["formats"][f][batch]["peer"] for f in fmts]
    ax.set_xticks(list(x), [f"{f}\n(peer: {p})" for f, p in zip(fmts, peers)], fontsize=8)
    ax.set(ylabel=f"decode tokens/s (batch {batch})", title="Weight formats, same model, median of interleaved rounds")
    ax.set_ylim(0, 1.25 * max(ax.get_ylim()[1], 1.0))
    ax.legend(fontsize=8, loc="upper left", ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
