"""Functions the layer-sharding tests run on every rank (module level, so they pickle by reference)."""

from __future__ import annotations

import math
import re

import torch


def generate_layer_sharded(ctx, model_dir: str, axes: dict, series: str, k: int, prompts, new_tokens: int, backend: str):
    """Load with ``series`` layer-sharded over dp, generate; returns (tokens, series shapes, resident bytes, state bytes)."""
    from functional_npu import compile_model, load_checkpoint
    from functional_npu.generate import greedy_generate
    from functional_npu.layer_shard import layer_shard, resident_bytes

    mesh = ctx.mesh(axes)
    params = load_checkpoint(model_dir, mesh, layer_shard=layer_shard(series, "dp"))
    if backend == "none":
        tokens = greedy_generate(params, prompts, new_tokens, mesh, prefetch_step=k)
        state_bytes = 0
    else:
        torch._dynamo.reset()
        model = compile_model(params, mesh, backend=backend, batch_sizes=[1, 4], max_seq_len=64, prefetch_step=k)
        tokens = model.generate(prompts, new_tokens)
        state = model.new_prefetch()
        state_bytes = resident_bytes(state)
        from functional_npu.prefetch import drain

        drain(state)
    shapes = {leaf: tuple(x.shape) for leaf, x in params["series"].items()}
    layers = params["config"].num_layers
    replicated = layers * sum(math.prod(x.shape[1:]) * x.element_size() for x in params["series"].values())  # this rank's share without layer sharding
    return tokens, shapes, resident_bytes(params["series"]), state_bytes, replicated


def decode_code(ctx, model_dir: str, axes: dict, series: str, k: int, schedule: str):
    """The inductor code of one decode step under a schedule: "prefetch" (ours), "default" or "raise_comms"."""
    from torch._inductor.utils import run_and_get_code

    from functional_npu import compile_model, load_checkpoint
    from functional_npu.layer_shard import layer_shard
    from functional_npu.models import llama
    from functional_npu.prefetch import drain

    mesh = ctx.mesh(axes)
    params = load_checkpoint(model_dir, mesh, layer_shard=layer_shard(series, "dp"))
    torch._dynamo.reset()
    model = compile_model(params, mesh, batch_sizes=[1], max_seq_len=64, prefetch_step=k)
    if schedule != "prefetch":
        import functools

        passes = [] if schedule == "default" else ["raise_comms"]
        options = {"reorder_for_compute_comm_overlap": bool(passes), "reorder_for_compute_comm_overlap_passes": passes}
        fwd = torch.compile(functools.partial(llama.forward), fullgraph=True, dynamic=False, options=options)
        model = type(model)(**{**model.__dict__, "forward": fwd})
    cache, state = model.new_cache(1), model.new_prefetch()
    with torch.no_grad():
        _, code = run_and_get_code(model.decode, torch.tensor([3]), torch.tensor([5]), cache, state)
    drain(state)
    return code[0]


# ---- reading the generated code ---------------------------------------------------------------------
_BUF = r"(buf\d+|arg\d+_\d+)"


def prefetch_events(code: str) -> dict:
    """Parse inductor's ``call()`` into the prefetch timeline.

    Returns ``{"issue": {buf: line}, "wait": {buf: line}, "use": {buf: line}, "live_max": n}``:
    the line of each broadcast, of each wait on a prefetched (broadcast or carried) buffer, of the
    first other line that reads it, and the most prefetch buffers alive at once (from the issue, or
    the start for carried inputs, to inductor's ``del`` of the buffer; a buffer reused for the next
    broadcast dies when it is reused).
    """
    body = code.split("def call(self, args):")[1]
    lines = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    issue, wait, use = {}, {}, {}
    for i, ln in enumerate(lines):
        m = re.match(rf"torch\.ops\._c10d_functional\.broadcast_\.default\({_BUF},", ln)
        if m:
            issue[m.group(1)] = i
        m = re.match(rf"torch\.ops\._c10d_functional\.wait_tensor\.default\({_BUF}\)", ln)
        if m and (m.group(1) in issue or m.group(1).startswith("arg")):
            wait[m.group(1)] = i
    for b, w in wait.items():
        later = [i for i in range(w + 1, len(lines)) if re.search(rf"\b{b}\b", lines[i]) and not lines[i].startswith(("del ", "return"))]
        if later:
            use[b] = later[0]
    live, peak = {b for b in wait if b.startswith("arg")}, 0
    for i, ln in enumerate(lines):
        for b, t in issue.items():
            if t == i:
                live.add(b)
        peak = max(peak, len(live))
        for dead in re.findall(rf"(?:^|; )del {_BUF}", ln):  # "del bufX", or "bufY = ...; del bufX  # reuse"
            live.discard(dead)
    kernels = [i for i, ln in enumerate(lines) if re.match(r"(extern_kernels\.|cpp_fused|torch\.ops\.|buf\d+ = torch\.ops\.)", ln)]
    return {"issue": issue, "wait": wait, "use": use, "live_max": peak, "kernels": kernels}
