"""The systems :mod:`benchmarks.bench_train` times, each built on one rank from the checkpoint at ``path`` for the
global batch ``tokens``: ``BUILDERS[name](ctx, path, tokens) -> System``. All take transformers' causal-LM loss, its
backward, and AdamW (:data:`HP`) after clipping the gradient to a global norm of ``MAX_NORM``; ``System.run()`` takes
one step and returns the loss (the mean over the ranks) and the gradient norm before clipping, as Python floats.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["HP", "MAX_NORM", "HOW", "COMPILED", "BUILDERS", "System"]

HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # AdamW's, every system's
MAX_NORM = 1.0
HOW = {
    "fnpu_tp2_compiled": "this library, tp 2, compile_train_step(backend='inductor'): one graph; whole batch per rank",
    "fnpu_tp2_eager": "this library, tp 2, compile_train_step(backend='none'); whole batch per rank",
    "fsdp2": "FSDP2 (fully_shard per layer + root), each layer torch.compile'd; half the batch per rank",
    "fsdp2_eager": "FSDP2 (fully_shard per layer + root), eager; half the batch per rank",
    "hf_tp": "transformers tp_plan='auto' (DTensor), each layer torch.compile'd; whole batch per rank",
    "hf_tp_eager": "transformers tp_plan='auto' (DTensor), eager; whole batch per rank",
}
COMPILED = ("fnpu_tp2_compiled", "fsdp2", "hf_tp")  # each must trace a graph, or it ran eagerly


class System(NamedTuple):
    """One system on this rank: ``run()`` one step -> (loss, grad norm); ``held()`` the bytes its training state
    holds on this rank (params, gradients, optimizer state: local shards); ``notes`` how it had to be run."""

    run: Callable[[], tuple[float, float]]
    held: Callable[[], int]
    notes: dict[str, str]


def _fnpu(ctx: Any, path: str, tokens: torch.Tensor, compiled: bool) -> System:
    from functional_npu import Plan, flatten_with_paths, load_checkpoint
    from functional_npu.runtime.training import AdamW, compile_train_step, lm_loss

    mesh = ctx.mesh({"tp": 2})
    params = load_checkpoint(path, mesh, Plan(tp="tp"), dtype=torch.float32)
    step = compile_train_step(
        lm_loss, AdamW(max_grad_norm=MAX_NORM, **HP), params, mesh, backend="inductor" if compiled else "none"
    )
    box = [params, step.init(params)]

    def run() -> tuple[float, float]:
        box[0], box[1], s = step(box[0], box[1], tokens)
        return s.loss, s.grad_norm

    def held() -> int:
        trees = (box[0], box[1].mu, box[1].nu)
        return sum(_nbytes(x) for t in trees for _, x in flatten_with_paths(t) if isinstance(x, torch.Tensor))

    return System(run, held, {})


def _fsdp2(ctx: Any, path: str, tokens: torch.Tensor, compiled: bool) -> System:
    import transformers as T
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for layer in model.model.layers:
        if compiled:
            layer.compile()
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = tokens.chunk(ctx.world_size)[ctx.rank]  # data parallel: this rank's half of the global batch
    return _torch_step(model, local)


def _hf_tp(ctx: Any, path: str, tokens: torch.Tensor, compiled: bool) -> System:
    import transformers as T
    from transformers.distributed import DistributedConfig

    tp = DistributedConfig(tp_plan="auto", tp_size=ctx.world_size)
    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=tp).train()
    q = model.model.layers[0].self_attn.q_proj.weight
    if not hasattr(q, "to_local") or q.to_local().shape[0] * ctx.world_size != q.shape[0]:
        raise RuntimeError(
            f"transformers did not shard q_proj over {ctx.world_size} ranks; its tp plan was not applied"
        )
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    return _torch_step(model, tokens)


def _torch_step(model: Any, tokens: torch.Tensor) -> System:
    """transformers' loss, ``backward``, the clip and ``torch.optim.AdamW(foreach=True)``. The
    params go in two groups of the same hyperparameters, DTensors and plain tensors: transformers' tp plan leaves the
    norm weights plain, and with them in one group ``step()`` raises "aten._foreach_mul_.Scalar got mixed
    torch.Tensor and DTensor"; two groups make the same update."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    kinds = [[p for p in params if isinstance(p, DTensor) == d] for d in (True, False)]
    groups = [g for g in kinds if g]
    opt = torch.optim.AdamW([{"params": g} for g in groups], foreach=True, **HP)
    notes: dict[str, str] = {}
    clip = _clipper(params, groups, notes)

    def run() -> tuple[float, float]:
        opt.zero_grad()
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        norm = clip()
        opt.step()
        return _mean(loss.detach()), float(_full(norm))

    def held() -> int:
        state = [x for s in opt.state.values() for x in s.values() if isinstance(x, torch.Tensor)]
        grads = [p.grad for p in params if p.grad is not None]
        return sum(_nbytes(x) for x in [*params, *model.buffers(), *grads, *state])

    return System(run, held, notes)


def _clipper(params: list, groups: list[list], notes: dict[str, str]) -> Callable[[], torch.Tensor]:
    """``clip_grad_norm_`` to ``MAX_NORM``; where it refuses the params (a mix of DTensors and plain tensors), the
    same clip by hand: each group's norm, the global norm of those, ``clip_grads_with_norm_`` per group. The first
    refusal is kept in ``notes["clip"]``."""

    def by_groups() -> torch.Tensor:
        norms = [_full(torch.nn.utils.get_total_norm([p.grad for p in g], foreach=True)) for g in groups]
        total = torch.linalg.vector_norm(torch.stack(norms))
        for g in groups:
            torch.nn.utils.clip_grads_with_norm_(g, MAX_NORM, total, foreach=True)
        return total

    refused: list[str] = []

    def clip() -> torch.Tensor:
        if not refused:
            try:
                return torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
            except RuntimeError as e:  # raised while taking the norm, before any gradient is touched
                refused.append(f"clip_grad_norm_ raised {type(e).__name__}: {e}".splitlines()[0])
                notes["clip"] = refused[0] + "; clipped by get_total_norm per group + clip_grads_with_norm_"
        return by_groups()

    return clip


BUILDERS = {
    "fnpu_tp2_compiled": functools.partial(_fnpu, compiled=True),
    "fnpu_tp2_eager": functools.partial(_fnpu, compiled=False),
    "fsdp2": functools.partial(_fsdp2, compiled=True),
    "fsdp2_eager": functools.partial(_fsdp2, compiled=False),
    "hf_tp": functools.partial(_hf_tp, compiled=True),
    "hf_tp_eager": functools.partial(_hf_tp, compiled=False),
}


def _full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def _nbytes(x: torch.Tensor) -> int:
    x = x.to_local() if hasattr(x, "to_local") else x
    return x.numel() * x.element_size()


def _mean(loss: torch.Tensor) -> float:
    """The mean of every rank's loss (data parallel: the global batch's; tp: the same loss on each)."""
    loss = _full(loss).clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()
