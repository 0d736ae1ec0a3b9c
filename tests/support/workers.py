"""Functions the multi-rank tests run on every rank (module level, so they pickle by reference)."""

from __future__ import annotations

import torch

from functional_npu import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    gather,
    permute,
    reduce_scatter,
    shard,
)

from .strategies import make_tensor


def recording_inductor(ops: list[str]):
    """An inductor backend that first records the call_function targets of the dynamo graph."""

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return compile_fx(gm, example_inputs)

    return backend


def compiled(fn, ops: list[str]):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=recording_inductor(ops))


def x_of(rank: int) -> torch.Tensor:
    return torch.arange(8.0).reshape(2, 4) + 100 * rank


def collectives_program(ctx, axes: dict[str, int], use_compile: bool):
    mesh = ctx.mesh(axes)
    n = mesh.axis_size("tp")

    def prog(x):
        return {
            "ar_tp": all_reduce(x, mesh, "tp"),
            "ar_all_max": all_reduce(x, mesh, ("dp", "tp"), "max"),
            "ag_dp_dim1": all_gather(x, mesh, "dp", dim=1),
            "rs_tp_dim1": reduce_scatter(x, mesh, "tp", dim=1),
            "a2a": all_to_all(x, mesh, "tp", split_dim=1, concat_dim=0),
            "bc_dp": broadcast(x, mesh, "dp", src=1),
            "perm": permute(x, mesh, ("dp", "tp"), [(i + 1) % mesh.size for i in range(mesh.size)]),
            "a2a_uneven": all_to_all_single(
                x.flatten()[: sum(range(1, n + 1))].unsqueeze(1),
                mesh,
                "tp",
                output_split_sizes=[mesh.axis_index("tp") + 1] * n,
                input_split_sizes=[j + 1 for j in range(n)],
            ),
        }

    ops: list[str] = []
    fn = compiled(prog, ops) if use_compile else prog
    out = fn(x_of(ctx.rank))
    return out, ops


def gather_roundtrip(ctx, axes, leaves, seed: int, use_compile: bool = False):
    """Shard a seeded full tree on this rank, gather it back; returns (bit-equal per leaf, op list)."""
    mesh = ctx.mesh(axes)
    tree = {f"w{i}": make_tensor(shape, dtype, seed + i) for i, (shape, dtype, _) in enumerate(leaves)}
    specs = {f"w{i}": lay for i, (_, _, lay) in enumerate(leaves)}
    local = shard(tree, specs, mesh)
    ops: list[str] = []
    if use_compile:
        mesh.init_groups()
    fn = compiled(lambda t: gather(t, specs, mesh), ops) if use_compile else (lambda t: gather(t, specs, mesh))
    full = fn(local)
    equal = {
        k: full[k].dtype == v.dtype and torch.equal(full[k].view(torch.uint8), v.view(torch.uint8))
        for k, v in tree.items()
    }
    aliased = any(
        full[k].untyped_storage().data_ptr() == local[k].untyped_storage().data_ptr() for k in tree if local[k].numel()
    )
    return equal, aliased, ops


def prefill_and_greedy(fwd, params, prompts, new_tokens: int, mesh, kernels=None):
    """The logits of one right-padded prefill ``[B, S, V]`` and the greedy tokens, both through ``fwd``
    (a forward with ``models.forward``'s signature), the tokens by the library's one generation path."""
    import dataclasses

    from functional_npu import compile_model
    from functional_npu.models import init_state

    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    model = compile_model(
        params,
        mesh,
        backend="none",
        batch_sizes=[len(prompts)],
        max_seq_len=width + new_tokens,
        prefill_lengths=[width],
        kernels=kernels,
    )
    state = init_state(params.config, mesh, len(prompts), width + new_tokens, params["embed"].dtype, plan=model.plan)
    with torch.no_grad():  # model.params: quantized weights in their kernels' forms
        logits = fwd(model.params, tokens, torch.arange(width).expand(len(prompts), width), state, mesh)
        out = dataclasses.replace(model, forward=fwd).generate(prompts, new_tokens)
    return logits, out


def llama_generate(ctx, model_dir: str, tp: int, prompts, new_tokens: int, use_compile: bool, kernels=None):
    """Load with tp ranks (the world is tp x dp), run one padded batch: (prefill logits, greedy tokens, bytes read,
    the compiled graph's ops); ``kernels``: whose quantized matmuls (``compile_model``'s)."""
    from functional_npu import Mesh
    from functional_npu.models import forward
    from functional_npu.runtime.loading.checkpoint import load_checkpoint

    mesh = ctx.mesh({"dp": ctx.world_size // tp, "tp": tp}) if ctx is not None else Mesh.abstract({"tp": 1}, 0)
    read: list[int] = []
    params = load_checkpoint(model_dir, mesh, on_read=lambda name, n: read.append(n))
    ops: list[str] = []
    fwd = forward
    if use_compile:
        mesh.init_groups() if not mesh.is_abstract else None
        torch._dynamo.reset()
        fwd = torch.compile(forward, fullgraph=True, dynamic=False, backend=recording_inductor(ops))
    logits, out = prefill_and_greedy(fwd, params, prompts, new_tokens, mesh, kernels)
    return logits, out, sum(read), ops


def redundant_placement(params, extra: list[int], order: list[int]):
    """Full MoE params moved to a hand-built placement: slots hold experts ``order + extra`` (a permutation of
    the experts, then redundant copies of hot ones); ``expert_map`` points each expert at all of its slots. Returns
    the params (no placement: the loaded one is the identity's) and the plan that counts the slots and copies."""
    from functional_npu import Plan
    from functional_npu.models import moe

    cfg = params.config
    slots = list(order) + list(extra)
    copies = max(slots.count(e) for e in range(cfg.num_experts))
    table = torch.full((cfg.num_experts, copies), -1, dtype=torch.long)
    for e in range(cfg.num_experts):
        where = [s for s, x in enumerate(slots) if x == e]
        table[e, : len(where)] = torch.tensor(where)
    plan = Plan(num_slots=len(slots), max_copies=copies)
    layers = []
    for layer in params["layers"]:
        if "router" in layer:
            layer = layer | {
                "experts_gate_up": layer["experts_gate_up"][slots],
                "experts_down": layer["experts_down"][slots],
                "expert_map": table,
            }
        layers.append(layer)
    assert moe.param_specs(cfg, plan)  # the placement is a valid plan
    return params.placed(None) | {"layers": layers}, plan


def moe_generate(
    ctx,
    model_dir: str,
    axes: dict,
    expert_axes,
    prompts,
    new_tokens: int,
    use_compile: bool,
    threshold: int | None = None,
    placement: tuple | None = None,
):
    """Load an MoE checkpoint on a dp x tp mesh with experts over ``expert_axes``; dp index i runs the prompts
    rotated by i. Returns (rotation, prefill logits, greedy tokens, bytes read, dynamo ops)."""
    import dataclasses

    from functional_npu import Mesh, Plan
    from functional_npu.core.shard import shard
    from functional_npu.models import forward, moe
    from functional_npu.placement import place
    from functional_npu.runtime.loading.checkpoint import load_checkpoint

    mesh = ctx.mesh(axes) if ctx is not None else Mesh.abstract(axes, 0)
    read: list[int] = []
    plan = Plan(expert_axes=expert_axes, dispatch_threshold=8 if threshold is None else threshold)
    if placement is None:
        params = load_checkpoint(model_dir, mesh, plan, on_read=lambda name, n: read.append(n))
    else:  # the whole model on this rank, moved to the placement, then sharded for the mesh
        full, slots = redundant_placement(load_checkpoint(model_dir, Mesh.abstract({"tp": 1}, 0)), *placement)
        plan = dataclasses.replace(slots, expert_axes=plan.expert_axes, dispatch_threshold=plan.dispatch_threshold)
        params = shard(full, moe.param_specs(full.config, plan), mesh, placement=place(full.config, mesh, plan))
    rot = mesh.axis_index("dp") if "dp" in axes else 0
    prompts = prompts[rot:] + prompts[:rot]
    ops: list[str] = []
    fwd = forward
    if use_compile:
        if not mesh.is_abstract:
            mesh.init_groups()
            mesh.init_groups(tuple(expert_axes)) if expert_axes else None
        torch._dynamo.reset()
        fwd = torch.compile(forward, fullgraph=True, dynamic=False, backend=recording_inductor(ops))
    logits, out = prefill_and_greedy(fwd, params, prompts, new_tokens, mesh)
    return rot, logits, out, sum(read), ops


def listening_addresses(ctx) -> list[str]:
    """The local addresses (hex ip:port, as /proc/net/tcp{,6} write them) of every socket this rank listens on."""
    import os

    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:  # state LISTEN, inode ours
                out.append(fields[1])
    return out


def bar_then_refuse_or_wait(ctx):
    """Every rank makes a (hidden) progress bar; rank 0 then raises while the others wait in a barrier."""
    import torch.distributed as dist
    from tqdm import tqdm

    with tqdm(total=1, disable=True):
        pass
    if ctx.rank == 0:
        raise ValueError("refused on rank 0")
    dist.barrier()
