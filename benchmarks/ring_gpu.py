"""The prefetch ring filled from host memory on a GPU: how much of the copies' time the compute hides, per phase.

:func:`ring_cell` builds a model of released shapes (:data:`benchmarks.configs.REAL`) cut to a few layers, in bf16 with
random weights on the device (:mod:`benchmarks.real_shapes`), and compiles it three ways with inductor without CUDA
graphs (which refuse a graph with host inputs; the resident model is compiled the same way, so the three differ only
in where the offloaded series come from):

- ``resident``: every weight on the device;
- ``k0``: the series (``offload``, default ``o_proj``) in pinned host memory, each layer's copy made when the layer
  is reached (``prefetch_step=0``): the copies' time is exposed;
- ``k1`` (and each further step of ``steps``): layer ``l + k``'s copy issued while layer ``l`` computes, on the
  side stream (:mod:`functional_npu.core.side_copy`);
- on CUDA, also ``resident_graphs`` (inductor's CUDA graphs) and ``k1_graphs`` (the largest step under the library's
  own graph around each step, :mod:`functional_npu.runtime.serving.step_graph`, as ``compile_model`` builds it for
  host series in a capturing mode): ``phases["captured"]`` is the ring's time over the resident one's, per phase,
  both captured.

Each system's greedy tokens must equal the resident model's (else the cell reports that and no figure). Then
``repeat`` interleaved rounds time a prefill of ``batch`` prompts of ``prompt`` tokens (``T(1 new token)``) and a
decode step (``(T(new) - T(1)) / (new - 1)``). Per phase and step: the copies' exposed time ``copy_s = k0 - resident``,
the compute ``resident``, the time hidden ``k0 - k`` and its share of what could be hidden, ``min(copy, compute)``;
round by round, medians with their spread. A prefill long enough computes longer than a layer's copy takes, so it can
hide all of it; a decode step at batch 1 reads each layer in a fraction of its copy, so it hides at most that
fraction.

``delivered`` counts, on the device (``torch.profiler``'s memcpy records), the host-to-device copies of one generate
of the largest step: their bytes, against the layer bytes they must carry (every slot write a whole layer's series);
a copy that did nothing shows as bytes missing. It is None off CUDA.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from functional_npu import Mesh, Plan, compile_model, reshard_params

from .real_shapes import available_bytes, device_params, needed_bytes, refusal
from .timing import generate_times, rounds, stats

__all__ = ["ring_cell", "hidden", "host_copies", "host_part_bytes"]

ONE = Mesh.abstract({"tp": 1}, 0)


def hidden(resident: float, exposed: float, ring: float) -> dict[str, float]:
    """One round's figures for one phase: ``resident`` seconds (the compute), ``exposed`` with every copy in the
    critical path (``k = 0``), ``ring`` with the copies issued ahead."""
    copy, saved = exposed - resident, exposed - ring
    return {
        "compute_s": resident,
        "copy_s": copy,
        "hidden_s": saved,
        "hidden_of_copy": saved / copy if copy > 0 else float("nan"),
        "hidden_of_hideable": saved / min(copy, resident) if min(copy, resident) > 0 else float("nan"),
    }


def host_copies(trace: dict[str, Any], least: int) -> dict[str, Any]:
    """The host-to-device copies of at least ``least`` bytes in a ``torch.profiler`` chrome trace: their count, bytes
    and the streams they ran on, beside the streams that ran kernels."""
    events = trace.get("traceEvents", [])
    copies = [
        e for e in events
        if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "") and e.get("args", {}).get("bytes", 0) >= least
    ]  # fmt: skip
    kernels = [e for e in events if e.get("cat") == "kernel"]
    busiest = statistics.mode([e["args"].get("stream") for e in kernels]) if kernels else None
    return {
        "copies": len(copies),
        "bytes": sum(e["args"]["bytes"] for e in copies),
        "copy_streams": sorted({e["args"].get("stream") for e in copies}),
        "compute_stream": busiest,
    }


def host_part_bytes(model: Any) -> list[int]:
    """The bytes of one layer of each series ``model`` keeps in host memory: the parts each ring write copies."""
    return [x[0].numel() * x[0].element_size() for x in model.params["host"].values()]


def ring_cell(
    cfg: Any,
    *,
    layers: int = 4,
    offload: str = "o_proj",
    steps: tuple[int, ...] = (1,),
    prompt: int = 2048,
    batch: int = 1,
    new: int = 16,
    repeat: int = 3,
    device: str = "cuda",
    backend: str = "inductor",
    log: Any = print,
) -> dict[str, Any]:
    """The cell (see the module docstring); ``{"skipped": why}`` in one line where the device lacks the memory."""
    cfg = dataclasses.replace(cfg, num_layers=layers)
    dtype = torch.bfloat16
    seq = prompt + new
    why = refusal(f"{layers}-layer ring model", needed_bytes(cfg, dtype, batch, seq), available_bytes(device), device)
    if why is not None:
        return {"skipped": why}
    mode = "default" if backend == "inductor" else None
    options = {"backend": backend, "mode": mode, "batch_sizes": [batch], "max_seq_len": seq}
    options["prefill_lengths"] = [prompt]
    params = device_params(cfg, dtype, device)
    models = {"resident": compile_model(params, ONE, **options)}
    for k in (0, *steps):
        moved = reshard_params(params, Plan(offload=offload, prefetch_step=k), ONE)
        models[f"k{k}"] = compile_model(moved, ONE, **options)
    captured = backend == "inductor" and device.startswith("cuda")
    if captured:  # the same two under captured graphs: inductor's for the resident model, the library's for the ring
        graphs = options | {"mode": "reduce-overhead"}
        models["resident_graphs"] = compile_model(params, ONE, **graphs)
        models[f"k{max(steps)}_graphs"] = compile_model(moved, ONE, **graphs)
        assert models[f"k{max(steps)}_graphs"].captured == "library", models[f"k{max(steps)}_graphs"].captured
    prompts = [[(7 * i + j) % cfg.vocab_size for i in range(1, prompt + 1)] for j in range(batch)]
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None

    def run(model: Any, n: int) -> Any:
        out = model.generate(prompts, n)
        sync()
        return out

    t0, tokens = time.perf_counter(), {}
    for name, model in models.items():
        tokens[name] = run(model, new)  # the first call compiles
        log(f"  ring: {name} compiled and run ({time.perf_counter() - t0:.0f} s)")
    wrong = [name for name, got in tokens.items() if got != tokens["resident"]]
    if wrong:
        return {"skipped": f"tokens of {wrong} differ from the resident model's: no figure reported"}
    timed = rounds({name: lambda m=m: generate_times(lambda n: run(m, n), new) for name, m in models.items()}, repeat)
    prefill = {name: [t1 for _, t1 in got] for name, got in timed.items()}
    decode = {name: [(tn - t1) / (new - 1) for tn, t1 in got] for name, got in timed.items()}
    phases: dict[str, dict[str, Any]] = {"prefill": {}, "decode": {}}
    for phase, per in (("prefill", prefill), ("decode", decode)):
        for k in steps:  # each round's figures, then each figure's median and spread over the rounds
            each = [hidden(*r) for r in zip(per["resident"], per["k0"], per[f"k{k}"])]
            phases[phase][f"k{k}"] = {key: stats([x[key] for x in each]) for key in each[0]}
    if captured:  # per round, the ring's step under the library's graphs over the resident one under inductor's
        k = max(steps)
        phases["captured"] = {
            phase: stats([a / b for a, b in zip(per[f"k{k}_graphs"], per["resident_graphs"])])
            for phase, per in (("prefill", prefill), ("decode", decode))
        }
    last = models[f"k{max(steps)}"]
    parts = host_part_bytes(last)
    return {
        "model": cfg.to_hf(),
        "offload": offload,
        "layer_bytes": sum(parts),
        "settings": {"layers": layers, "prompt": prompt, "batch": batch, "new": new, "repeat": repeat},
        "seconds": {name: {"prefill": prefill[name], "decode_step": decode[name]} for name in models},
        "phases": phases,
        "delivered": _delivered(lambda: run(last, 2), parts) if device.startswith("cuda") else None,
        "build_s": time.perf_counter() - t0,
    }


def _delivered(generate: Any, parts: list[int]) -> dict[str, Any]:
    """The host copies of one generate (:func:`host_copies`, counted on the device), against whole layers of
    ``parts``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        got = host_copies(json.loads(path.read_text()), min(parts))
    beside = got["copies"] > 0 and got["compute_stream"] not in got["copy_streams"]
    return got | {"whole_layers": got["bytes"] / sum(parts), "beside_compute": beside}
