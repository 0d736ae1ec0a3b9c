"""Functions the layer-sharding tests run on every rank (module level, so they pickle by reference)."""

from __future__ import annotations

import dataclasses
import math

import torch


def generate_layer_sharded(
    ctx, model_dir: str, axes: dict, series: str, k: int, prompts, new_tokens: int, backend: str
):
    """Load with ``series`` layer-sharded over dp, generate, every ring write watched by :class:`Deliveries` against
    the resident model's weights (loaded on the same mesh without layer sharding); returns (tokens, series shapes,
    resident bytes, state bytes, replicated bytes, deliveries)."""
    from functional_npu import Plan, compile_model, flatten_with_paths, greedy_generate, load_checkpoint
    from functional_npu.parallel.layer_shard import layer_shard, resident_bytes
    from functional_npu.parallel.prefetch_ring import ring_of

    from .delivery import Deliveries, ring_reference

    mesh = ctx.mesh(axes)
    plan = Plan(layer_shard=layer_shard(series, "dp"), prefetch_step=k)
    params = load_checkpoint(model_dir, mesh, plan)
    resident = load_checkpoint(model_dir, mesh)
    ring = ring_of(params, mesh, plan)
    layers = [dict(flatten_with_paths(layer)) for layer in resident["layers"]]
    record = Deliveries(ring_reference(layers, [g.leaves for g in ring.groups]))
    if backend == "none":
        with record:
            tokens = greedy_generate(params, prompts, new_tokens, mesh)
        state_bytes = 0
    else:
        torch._dynamo.reset()
        model = compile_model(params, mesh, backend=backend, batch_sizes=[1, 4], max_seq_len=64)
        with record:
            tokens = model.generate(prompts, new_tokens)
        state = model.new_state(1)
        state_bytes = resident_bytes(state.prefetched)
        from functional_npu.parallel.prefetch import drain

        drain(state.prefetched)
    shapes = {leaf: tuple(x.shape) for leaf, x in params["series"].items()}
    layers = params.config.num_layers
    replicated = layers * sum(
        math.prod(x.shape[1:]) * x.element_size() for x in params["series"].values()
    )  # this rank's share without layer sharding
    seen = record.summary() | {"groups": len(ring.groups)}
    return tokens, shapes, resident_bytes(params["series"]), state_bytes, replicated, seen


def ring_logits(ctx, model_dir: str, axes: dict, series: str, ks, steps: int, backend: str, also=()):
    """Prefill then ``steps`` decode steps (crossing step boundaries, so the carried layers and the ring's turn
    matter), unsharded and layer-sharded at each prefetch step of ``ks``, compiled with ``backend`` (and at each
    ``(k, backend)`` of ``also``, keyed so): the largest logit difference from the unsharded model (compiled with
    ``backend``), the ring's tensors before and after (the same ones, by storage), and what each ring write delivered
    (:class:`Deliveries`, from ``new_state`` to the drain, with the groups, a forward's bytes and the forwards run)."""
    from functional_npu import Plan, compile_model, flatten_with_paths, load_checkpoint
    from functional_npu.parallel import prefetch
    from functional_npu.parallel.layer_shard import layer_shard

    from .delivery import Deliveries, ring_reference

    mesh = ctx.mesh(axes)

    resident = load_checkpoint(model_dir, mesh)
    layers = [dict(flatten_with_paths(layer)) for layer in resident["layers"]]

    def run(params, plan=None, backend=backend):
        torch._dynamo.reset()
        model = compile_model(params, mesh, plan=plan, backend=backend, batch_sizes=[2], max_seq_len=32)
        groups = [g.leaves for g in model.ring.groups] if model.ring is not None else []
        reference = ring_reference(layers, groups)
        with Deliveries(reference) as record:
            state = model.new_state(2)
            ring = {t.untyped_storage().data_ptr() for t in state.prefetched}
            out = [model.prefill([[5, 9, 2], [7, 1]], state, length=4)]
            tok = out[0].argmax(-1)
            for i in range(steps):
                out.append(model.decode(tok, torch.tensor([3 + i, 2 + i]), state))
                tok = out[-1].argmax(-1)
            same = ring == {t.untyped_storage().data_ptr() for t in state.prefetched}
            prefetch.drain(state.prefetched)
        per_forward = sum(r.numel() * r.element_size() for layer in reference for r in layer)
        seen = record.summary() | {"groups": len(groups), "per_forward": per_forward, "forwards": 1 + steps}
        return torch.stack(out), same, len(ring), seen

    ref, _, _, _ = run(resident)
    params = load_checkpoint(model_dir, mesh, Plan(layer_shard=layer_shard(series, "dp")))
    result = {}
    for k in ks:
        got, same, slots, seen = run(params, dataclasses.replace(params.placement.plan, prefetch_step=k))
        result[k] = (float((got - ref).abs().max()), same, slots, seen)
    for k, other in also:
        got, same, slots, seen = run(params, dataclasses.replace(params.placement.plan, prefetch_step=k), other)
        result[(k, other)] = (float((got - ref).abs().max()), same, slots, seen)
    return result


def ring_hazards(
    ctx,
    model_dir: str,
    axes: dict,
    series: str,
    k: int,
    streams: str = "inline",
    copy_back: bool = False,
    passes: tuple | None = None,
):
    """One decode step of a layer-sharded model at prefetch step ``k``: the hazard check over the functionalized FX
    graph's partial order (what every compiler reorders within; ``copy_back``: its epilogue's copies into the slots
    count as reads) and over inductor's generated order, and what inductor's post-grad graph does with the ring's
    slots. ``streams``: the hints the FX graph is traced with, "inline" (inductor's), "copy-back" (aot_eager's) or
    "unordered" (the control; then, and with ``copy_back``, only the FX check runs). ``passes``: inductor's comm
    reordering passes to compile with instead of compile_model's (``()``: none, inductor's default order). Returns
    (fx violations, inductor violations, facts: the post-grad graph's writes, its code and the input layout)."""
    import functools

    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import run_and_get_code

    from functional_npu import Plan, compile_model, load_checkpoint
    from functional_npu.checks import check, dynamo_inputs, from_fx, from_inductor_code
    from functional_npu.models import family_of
    from functional_npu.models.decoder import decode as forward
    from functional_npu.parallel import prefetch
    from functional_npu.parallel.layer_shard import layer_shard
    from functional_npu.parallel.streams import COPY_BACK, INLINE, UNORDERED

    mesh = ctx.mesh(axes)
    params = load_checkpoint(model_dir, mesh, Plan(layer_shard=layer_shard(series, "dp"), prefetch_step=k))
    torch._dynamo.reset()
    model = compile_model(params, mesh, batch_sizes=[1], max_seq_len=64)
    groups = len(model.ring.groups)
    slots = model.ring.buffers
    tok, pos = torch.tensor([[3]]), torch.tensor([[5]])

    graphs, layouts = [], []

    def keep(gm, _):
        graphs.append(gm)
        return gm.forward

    aot = aot_autograd(fw_compiler=keep)

    def backend(gm, example_inputs):  # the input layout: which graph input is which (dynamo's sources)
        layouts.append(dynamo_inputs(gm))
        return aot(gm, example_inputs)

    state = model.new_state(1)
    hints = {"inline": INLINE, "copy-back": COPY_BACK, "unordered": UNORDERED}[streams]
    blocks = family_of(model.config).blocks(model.config, model.plan)
    fn = functools.partial(forward, blocks=blocks, plan=model.plan, streams=hints, ring=model.ring)
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True)(model.params, tok, pos, state, mesh)
    prefetch.drain(state.prefetched)
    inputs = layouts[0]
    fx_program = from_fx(graphs[0].graph, k, groups, copy_back=copy_back, inputs=inputs)
    fx = check(fx_program, k, slots)
    if streams != "inline" or copy_back:  # the FX graph's check only: inductor reinplaces, it copies nothing back
        return fx, None, None
    torch._dynamo.reset()
    state = model.new_state(1)
    post: list[torch.fx.Graph] = []

    def after_post_grad(graph: torch.fx.Graph) -> None:  # inductor's graph after its reinplace pass
        post.append(graph)

    if passes is not None:
        comm = {
            "reorder_for_compute_comm_overlap": bool(passes),
            "reorder_for_compute_comm_overlap_passes": list(passes),
        }
        step = functools.partial(
            forward,
            blocks=family_of(model.config).blocks(model.config, model.plan),
            plan=model.plan,
            streams=model.backend.streams,
            ring=model.ring,
        )
        model = dataclasses.replace(model, forward=model.backend.compile(step, dynamic=False, inductor_options=comm))
    with torch.no_grad(), torch._inductor.config.patch(post_grad_custom_post_pass=after_post_grad):
        _, code = run_and_get_code(model.decode, torch.tensor([3]), torch.tensor([5]), state)
    prefetch.drain(state.prefetched)
    nodes = list(post[0].nodes)
    # inductor compiled the same function of the same arguments: the same inputs, in the same order
    shapes = [
        [tuple(n.meta["val"].shape) for n in g.nodes if n.op == "placeholder"] for g in (graphs[0].graph, post[0])
    ]
    assert shapes[0] == shapes[1], shapes
    writes = [n for n in nodes if str(n.target) == "functional_npu.broadcast_into.default"]
    slots = {n.args[0] for n in writes}
    facts = {
        "writes": len(writes),
        "written": sorted(str(x) for x in slots),
        "into_inputs": all(x.op == "placeholder" for x in slots),
        "functional": sum(
            str(n.target).startswith(("auto_functionalized", "_c10d_functional.broadcast")) for n in nodes
        ),
        "copies_into_slots": [
            f"{n.name}({n.args[0]}, {n.args[1]})"
            for n in nodes
            if str(n.target) == "aten.copy_.default" and n.args[0] in slots and n.args[1] is not n.args[0]
        ],  # a copy of a slot into itself is dropped at lowering
        "code": code[0],
        "inputs": inputs,
        "fx_read_layers": sorted({layer for _, layer in fx_program.reads.values() if layer is not None}),
    }
    return fx, check(from_inductor_code(code[0], k, groups, inputs=inputs), k, (k + 1) * groups), facts


def decode_code(ctx, model_dir: str, axes: dict, series: str, k: int):
    """The inductor code of one decode step of a layer-sharded model compiled with prefetch step ``k``."""
    from torch._inductor.utils import run_and_get_code

    from functional_npu import Plan, compile_model, load_checkpoint
    from functional_npu.parallel.layer_shard import layer_shard
    from functional_npu.parallel.prefetch import drain

    mesh = ctx.mesh(axes)
    params = load_checkpoint(model_dir, mesh, Plan(layer_shard=layer_shard(series, "dp"), prefetch_step=k))
    torch._dynamo.reset()
    model = compile_model(params, mesh, batch_sizes=[1], max_seq_len=64)
    state = model.new_state(1)
    with torch.no_grad():
        _, code = run_and_get_code(model.decode, torch.tensor([3]), torch.tensor([5]), state)
    drain(state.prefetched)
    return code[0]


def ring_addresses(ctx, model_dir: str, axes: dict, series: str, k: int, steps: int, old_turn: bool = False):
    """Prefill then ``steps`` decode steps of a layer-sharded model at prefetch step ``k``, compiled by dynamo with a
    backend that records, at every call of every graph, the address of each ring slot among its inputs (by input
    index). Returns ``(graphs, logits)``: per graph, the set of address tuples it was called with, and each step's
    logits. ``old_turn``: the counterexample, the ring as it was kept before phases (its list turned by
    ``L mod (k + 1)`` between steps, every step numbered from phase 0)."""
    import functools

    from functional_npu import Plan, compile_model, load_checkpoint
    from functional_npu.models.decoder import decode
    from functional_npu.parallel import prefetch
    from functional_npu.parallel.layer_shard import layer_shard

    mesh = ctx.mesh(axes)
    params = load_checkpoint(model_dir, mesh, Plan(layer_shard=layer_shard(series, "dp"), prefetch_step=k))
    model = compile_model(params, mesh, backend="none", batch_sizes=[2], max_seq_len=32)
    graphs: list[set] = []

    def recording(gm, example_inputs):
        slots = {t.untyped_storage().data_ptr() for t in state.prefetched}
        graphs.append(set())
        calls = graphs[-1]

        def run(*args):
            calls.add(tuple((i, a.data_ptr()) for i, a in enumerate(args) if _ptr(a) in slots))
            return gm(*args)

        return run

    def _ptr(a):
        return a.untyped_storage().data_ptr() if isinstance(a, torch.Tensor) else None

    torch._dynamo.reset()
    static = model.forward.keywords  # backend "none": the plain forward, its static keywords bound
    fwd = torch.compile(functools.partial(decode, **static), backend=recording, fullgraph=True, dynamic=False)
    model = dataclasses.replace(model, forward=fwd)
    state = model.new_state(2)
    L, groups = model.config.num_layers, len(model.ring.groups)
    out = [model.prefill([[5, 9, 2], [7, 1]], state, length=4)]
    tok = out[0].argmax(-1)
    for i in range(steps):
        if old_turn:  # the list turned as the next step numbers it, the phase left at 0
            r = L % (k + 1) * groups
            state.prefetched[:] = state.prefetched[r:] + state.prefetched[:r]
            state.phase.at = 0
        out.append(model.decode(tok, torch.tensor([3 + i, 2 + i]), state))
        tok = out[-1].argmax(-1)
    prefetch.drain(state.prefetched)
    return [sorted(calls) for calls in graphs], torch.stack(out)


def ring_saved_graphs(ctx, model_dir: str, cache_dir: str, k: int, prompts, new_tokens: int):
    """Compile a layer-sharded model at prefetch step ``k`` with ``cache_dir`` twice (dynamo reset between): the
    tokens, the graphs loaded and the graphs compiled, each time."""
    from functional_npu import Plan, compile_model, load_checkpoint
    from functional_npu.parallel.layer_shard import layer_shard

    mesh = ctx.mesh({"dp": 2, "tp": 1})
    params = load_checkpoint(model_dir, mesh, Plan(layer_shard=layer_shard("o_proj,down_proj", "dp"), prefetch_step=k))
    out = []
    for _ in range(2):
        torch._dynamo.reset()
        shapes = dict(batch_sizes=[1], max_seq_len=16, prefill_lengths=[4])
        model = compile_model(params, mesh, backend="aot_eager", cache_dir=cache_dir, **shapes)
        out.append((model.generate(prompts, new_tokens), list(model.forward.loaded), list(model.forward.compiled_now)))
    return out
