"""Functions the EPLB and EP<->TP multi-rank tests run on every rank (module level, so they pickle by reference)."""

from __future__ import annotations

import torch

from benchmarks.counting import ReceivedBytes
from functional_npu import shard
from functional_npu.eplb import plan_rebalance, rebalance, routing_table
from functional_npu.interop import ep_to_tp, expert_layouts, tp_to_ep

from .strategies import make_tensor
from .workers import compiled


def _compiled(fn, mode: str, ops: list[str]):
    """``fn`` as run: "eager"; "inductor" (records the dynamo graph's ops);
    "aten" (records the aten graph, aot_autograd)."""
    if mode == "eager":
        return fn
    if mode == "inductor":
        return compiled(fn, ops)
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, _):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def expert_weights(layers: int, experts: int, ffn: int, hidden: int, dtype, seed: int):
    """Full per-layer logical expert weights: gate_up [L, E, 2F, D], down [L, E, D, F]."""
    return make_tensor((layers, experts, 2 * ffn, hidden), dtype, seed), make_tensor(
        (layers, experts, hidden, ffn), dtype, seed + 1
    )


def placed(
    gate_up: torch.Tensor, down: torch.Tensor, placement: torch.Tensor, rank: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the rows rank ``rank`` holds under ``placement``: each slot gets its expert's weights."""
    return [(gate_up[li, placement[li, rank]], down[li, placement[li, rank]]) for li in range(placement.shape[0])]


def moe_params(local, table: torch.Tensor, dense_every: int = 2) -> dict:
    """A params tree with MoE layers (and a dense layer in between) around the experts of ``local``."""
    layers = []
    for li, (gu, dn) in enumerate(local):
        layers.append(
            {
                "attn_norm": torch.ones(4),
                "router": torch.full((table.shape[1], 4), float(li)),
                "experts_gate_up": gu,
                "experts_down": dn,
                "expert_map": table[li],
            }
        )
        if li % dense_every == 0:
            layers.append({"attn_norm": torch.ones(4), "gate_up": torch.zeros(6, 4)})
    return {"embed": torch.zeros(3, 4), "layers": layers}


def rebalance_program(ctx, axes: dict[str, int], axis, old, new, experts: int, dtype, seed: int, mode: str):
    """Rebalance this rank's experts from ``old`` to ``new`` over ``axis``; returns checks, the op list and, eagerly,
    the bytes this rank received (counted at the collectives) with the least it could receive (from the
    placements)."""
    mesh = ctx.mesh(axes)
    rank = mesh.axis_index(axis)
    old, new = torch.tensor(old), torch.tensor(new)
    gate_up, down = expert_weights(old.shape[0], experts, 4, 3, dtype, seed)
    width = int(routing_table(new, experts).shape[2]) + 1  # a wider map than either needs: the width is kept
    params = moe_params(placed(gate_up, down, old, rank), routing_table(old, experts, copies=width))
    before = [(k, v.clone()) for layer in params["layers"] for k, v in layer.items()]
    plan = plan_rebalance(old, new, experts)
    ops: list[str] = []
    mesh.init_groups(axis)
    fn = _compiled(lambda p: rebalance(p, plan, mesh, axis), mode, ops)
    if mode == "eager":  # torch.compile refuses a dispatch mode around it: only eager runs are counted
        with ReceivedBytes() as counted:
            out = fn(params)
    else:
        out = fn(params)
    # the least this rank can receive: one copy of each expert its new slots hold and its old ones do not
    per_expert = (gate_up[0, 0].numel() + down[0, 0].numel()) * gate_up.element_size()
    need = sum(len(set(n[rank].tolist()) - set(o[rank].tolist())) for o, n in zip(old, new)) * per_expert
    want = placed(gate_up, down, new, rank)
    moe = [layer for layer in out["layers"] if "experts_gate_up" in layer]
    table = routing_table(new, experts, copies=width)
    return {
        "experts": all(
            _bits_equal(m["experts_gate_up"], gu) and _bits_equal(m["experts_down"], dn)
            for m, (gu, dn) in zip(moe, want)
        ),
        "maps": all(torch.equal(m["expert_map"], table[li]) for li, m in enumerate(moe)),
        "layers": len(out["layers"]) == len(params["layers"]) and out["embed"] is params["embed"],
        "inputs_untouched": all(
            _bits_equal(v, b) for (k, b), v in zip(before, (v for layer in params["layers"] for v in layer.values()))
        ),
        "ops": ops,
        "received": counted.received if mode == "eager" else None,
        "need": need,
    }


def ep_tp_program(ctx, axes: dict[str, int], axis, experts: int, ffn: int, hidden: int, dtype, seed: int, mode: str):
    """EP -> TP -> EP over ``axis``: compare each step with ``shard`` of the full tensors (bit for bit)."""
    mesh = ctx.mesh(axes)
    full = {
        "experts_gate_up": make_tensor((experts, 2 * ffn, hidden), dtype, seed),
        "experts_down": make_tensor((experts, hidden, ffn), dtype, seed + 1),
    }
    ep_local = shard(full, expert_layouts("ep", ffn, axis), mesh)
    tp_local = shard(full, expert_layouts("tp", ffn, axis), mesh)
    before = {k: v.clone() for k, v in ep_local.items()}
    ops: list[str] = []
    mesh.init_groups(axis)
    got_tp = _compiled(lambda t: ep_to_tp(t, mesh, axis), mode, ops)(ep_local)
    back = _compiled(lambda t: tp_to_ep(t, mesh, axis), mode, ops)(got_tp)
    return {
        "tp": all(_bits_equal(got_tp[k], tp_local[k]) for k in full),
        "roundtrip": all(_bits_equal(back[k], ep_local[k]) for k in full),
        "inputs_untouched": all(_bits_equal(ep_local[k], before[k]) for k in full),
        "ops": ops,
    }
