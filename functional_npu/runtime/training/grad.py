"""Gradients of the sharded forward: ``value_and_grad(loss_fn)(params, batch, mesh)``, as in JAX.

``loss_fn(params, batch, mesh)`` is any function of this rank's params that returns this rank's scalar loss,
typically through :func:`logits` / :func:`token_logprobs` (the family's one forward, run on a cache the
length of the sequence, layer-sharded weights by differentiable broadcasts). The value differentiated is the
**mean of every rank's loss**: ranks that compute the same loss (a tensor-parallel group on one batch) count
as that loss, ranks with their own batches (data parallel) are averaged. So a data-parallel step's gradient
is the mean over its batches, and every rank on the same batch gets transformers' own gradient.

How: ``torch.func.grad_and_value`` differentiates ``loss / world`` on each rank; every collective in the
forward is differentiated by its transpose (:mod:`functional_npu.core.collective_grads`), which sums
contributions across ranks exactly where the forward exchanged them; the shares of a replicated
parameter are then summed over the ranks that hold it, read from its layout
(:mod:`functional_npu.core.replica_sum`). The gradients come back as a tree of the params' structure,
each leaf a shard in its param's own layout (``None`` for a leaf that is not a float tensor, such as
``expert_map``, and for a family's buffers, such as DeepSeek-V3's routing correction bias).

Example:
    >>> def loss_fn(params, tokens, mesh):                                   # doctest: +SKIP
    ...     return -token_logprobs(params, tokens, mesh).mean()
    >>> loss, grads = value_and_grad(loss_fn)(params, tokens, mesh)          # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ...core.collectives import all_reduce
from ...core.mesh import Mesh
from ...core.params import Params
from ...core.replica_sum import ReplicaSum, replica_plan, sum_replicas
from ...core.tree import flatten_with_paths, map_with_path, replace_leaves
from ...models import family_of, forward, init_state, plan_of
from ...parallel.offload import check_no_host_series
from ...placement.placement import placement_of
from ..serving.generate import MIN_TEMPERATURE, logprobs_of
from .batch import check_batch, check_ids, check_token_shape

__all__ = ["value_and_grad", "logits", "token_logprobs", "lm_loss", "Differentiable", "differentiable"]

LossFn = Callable[[dict, Any, Mesh], torch.Tensor]


def logits(
    params: dict, tokens: torch.Tensor, mesh: Mesh, *, attention: str = "sdpa", where: str = "logits"
) -> torch.Tensor:
    """``[B, S, V]`` logits of ``tokens [B, S]`` (positions ``0 .. S-1``): the family's forward, differentiable,
    on a fresh cache of ``S`` slots (so training and inference run the same code).

    Raises:
        TypeError / ValueError naming ``where`` and the argument: params with no config or that keep series in host
        memory (a serving plan), a mesh that is no :class:`Mesh`, tokens that are not a 2-D integer tensor or hold
        more positions than the model has; on CPU tokens, an id outside the vocabulary.
    """
    check_inputs(params, tokens, mesh, where, min_length=1)
    return _logits(params, tokens, mesh, attention)


def _logits(params: dict, tokens: torch.Tensor, mesh: Mesh, attention: str) -> torch.Tensor:
    cfg, plan = params.config, plan_of(params)
    b, s = tokens.shape
    state = init_state(cfg, mesh, b, s, _dtype(params), plan=plan, device=tokens.device)
    positions = torch.arange(s, device=tokens.device).expand(b, s)
    return forward(params, tokens, positions, state, mesh, attention=attention, plan=plan, differentiable=True)


def check_inputs(params: Any, tokens: Any, mesh: Any, where: str, *, min_length: int = 2) -> None:
    """Refuse, naming ``where`` and the argument, what the training forward cannot take (see :func:`logits`). The
    ids are read only from CPU tokens outside tracing: no device sync on a step's hot path."""
    check_params(params, where)
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{where}: mesh must be a functional_npu.Mesh (Mesh.abstract({{'tp': 1}}, 0) for one process), got "
            f"{type(mesh).__name__}"
        )
    check_no_host_series(params, where)
    check_token_shape(tokens, f"{where}: tokens", min_length)
    limit, length = getattr(params.config, "max_position_embeddings", None), tokens.shape[1]
    if limit is not None and length > limit:
        raise ValueError(
            f"{where}: tokens hold {length} positions, more than the model's {limit} (max_position_embeddings); "
            f"split or truncate the sequences to at most {limit} tokens"
        )
    if tokens.device.type == "cpu" and not torch.compiler.is_compiling():
        check_ids(tokens, params.config.vocab_size, f"{where}: tokens")


def check_params(params: Any, where: str) -> None:
    """``params`` a :class:`Params` with a model config, else a TypeError naming ``where``."""
    if not isinstance(params, Params) or params.config is None:
        raise TypeError(
            f"{where}: params must be a functional_npu.Params with a model config (load_checkpoint's, or "
            f"Params(tree, config)), got {type(params).__name__}"
        )


def token_logprobs(
    params: dict, tokens: torch.Tensor, mesh: Mesh, *, attention: str = "sdpa", temperature: float = 1.0
) -> torch.Tensor:
    """``[B, S - 1]``: log p(``tokens[:, t + 1]`` | ``tokens[:, :t + 1]``) under ``softmax(logits / temperature)``,
    in float32 (or float64 params).

    Raises:
        TypeError / ValueError naming the argument, as :func:`logits` does, and for sequences of fewer than 2 tokens
        or a ``temperature`` that is not a finite number >= ``MIN_TEMPERATURE``.
    """
    return _token_logprobs(params, tokens, mesh, attention, temperature, "token_logprobs")


def _token_logprobs(
    params: dict, tokens: torch.Tensor, mesh: Mesh, attention: str, temperature: Any, where: str
) -> torch.Tensor:
    check_inputs(params, tokens, mesh, where)
    _check_temperature(temperature, where)
    invariant = plan_of(params).invariant  # the plan's invariant mode: the rollout's bits (models.invariant)
    got = _logits(params, tokens, mesh, attention)
    return logprobs_of(got[:, :-1], tokens[:, 1:], temperature, invariant)


def _check_temperature(temperature: Any, where: str) -> None:
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise TypeError(
            f"{where}: temperature must be a number (the rollout's sampling temperature), got "
            f"{type(temperature).__name__} {temperature!r}"
        )
    if not (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
        raise ValueError(
            f"{where}: temperature must be a finite number >= {MIN_TEMPERATURE} (the rollout's sampling temperature; "
            f"a greedy rollout's log-probabilities are at 1.0), got {temperature!r}"
        )


def lm_loss(params: dict, tokens: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The causal language-model loss transformers computes with ``labels=tokens``: the mean next-token
    negative log-likelihood over ``B x (S - 1)`` tokens.

    Raises:
        TypeError / ValueError naming the argument, as :func:`token_logprobs` does (a one-token sequence, whose mean
        over no prediction would be NaN, among them).
    """
    return -_token_logprobs(params, tokens, mesh, "sdpa", 1.0, "lm_loss").mean()


def _dtype(params: dict) -> torch.dtype:
    for _, x in flatten_with_paths(params):
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
            return x.dtype
    raise ValueError("params hold no floating-point tensor")


class Differentiable:
    """The parts of a params tree a gradient is taken over, checked once (:func:`differentiable`).

    Attributes:
        leaves: path -> the float tensor (detached), the gradient's inputs.
        sums: path -> :class:`~functional_npu.core.replica_sum.ReplicaSum` for that leaf.
        mesh: the mesh the params are sharded over.
        placement: their :class:`~functional_npu.placement.Placement`.
    """

    def __init__(self, params: dict, mesh: Mesh, where: str) -> None:
        check_params(params, where)
        scheme = getattr(params.placement, "quant", None)
        if scheme is not None:
            raise ValueError(
                f"{where}: the params are quantized ({scheme.quant!r}); gradients need floating-point weights: load "
                f"the checkpoint unquantized (or dequantize the params) to train"
            )
        check_no_host_series(params, where)
        _check_leaves(params, where)
        placed = placement_of(params, mesh, where=where)
        full, layouts = placed.meta_leaves, placed.layouts
        self.mesh, self.params, self.placement = mesh, params, placed
        buffers = family_of(params.config).buffers
        self.leaves = {
            p: x.detach()
            for p, x in flatten_with_paths(params)
            if isinstance(x, torch.Tensor) and _float(x) and p.rsplit(".", 1)[-1] not in buffers
        }
        self.sums = {p: replica_plan(layouts[p], full[p].shape, mesh.shape) for p in self.leaves}

    def skeleton(self) -> Differentiable:
        """This split with every tensor of its params on the meta device: the structure, shapes and dtypes a
        compiled step needs, without holding the params it was made from."""
        out = object.__new__(Differentiable)
        out.mesh, out.sums, out.placement = self.mesh, self.sums, self.placement
        out.params = map_with_path(lambda p, x: x.to("meta") if isinstance(x, torch.Tensor) else x, self.params)
        out.leaves = {p: x.to("meta") for p, x in self.leaves.items()}
        return out

    def tree(self, leaves: dict[str, torch.Tensor]) -> dict:
        """The params with ``leaves`` in place of the float tensors (every other node as it was)."""
        return replace_leaves(self.params, leaves)

    def whole(self, shares: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's gradient shares made whole (summed over each element's holders), by path."""
        return {p: sum_replicas(g, self.sums[p], self.mesh) for p, g in shares.items()}

    def grads(self, whole: dict[str, torch.Tensor]) -> dict:
        """Whole gradients by path as a params-shaped tree (``None`` where a leaf takes no gradient)."""
        return map_with_path(lambda p, x: whole.get(p), self.params)

    def axes(self) -> list[tuple[str, ...]]:
        """Every axis tuple the gradient's sums run over (their process groups must exist before tracing)."""
        out = {s.axes for s in self.sums.values() if s.axes} | {a for s in self.sums.values() for _, a, _ in s.partial}
        return sorted(out) + [tuple(self.mesh.axis_names)]


def _check_leaves(params: dict, where: str) -> None:
    """Every weight floating-point, in one dtype, on one device (the expert map excepted: integer slot indices)."""
    tensors = [(p, x) for p, x in flatten_with_paths(params) if isinstance(x, torch.Tensor)]
    ints = [(p, x) for p, x in tensors if not _float(x) and p.rsplit(".", 1)[-1] != "expert_map"]
    if ints:
        p, x = ints[0]
        raise ValueError(f"{where}: params[{p!r}] is {x.dtype}, not floating point; gradients need float weights")
    floats = [(p, x) for p, x in tensors if _float(x)]
    for what, key in (("dtype", lambda x: x.dtype), ("device", lambda x: x.device)):
        first = key(floats[0][1])
        odd = next(((p, key(x)) for p, x in floats if key(x) != first), None)
        if odd is not None:
            raise ValueError(
                f"{where}: params[{odd[0]!r}] is {odd[1]}, params[{floats[0][0]!r}] {first}: every weight must share "
                f"one {what}; load the params with one dtype (load_checkpoint(dtype=...)) on one device"
            )


def _float(x: torch.Tensor) -> bool:
    return x.dtype.is_floating_point


def differentiable(params: dict, mesh: Mesh, where: str = "value_and_grad") -> Differentiable:
    """The checked split of ``params`` into a gradient's inputs and the rest.

    Raises:
        TypeError / ValueError naming the leaf: params with no config, quantized params, a leaf of another
        shape than the plan gives it on ``mesh`` (params of another plan or mesh).
    """
    return Differentiable(params, mesh, where)


def check_loss(loss: Any, where: str = "loss_fn") -> torch.Tensor:
    """``loss`` if it is a scalar floating-point tensor; else a one-line error naming what it is."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{where} must return a scalar tensor (this rank's loss), got {type(loss).__name__}")
    if loss.ndim != 0:
        raise ValueError(
            f"{where} must return a scalar (this rank's loss), got a tensor of shape {tuple(loss.shape)}; "
            f"reduce it (.mean() or .sum()) in the loss"
        )
    if not loss.dtype.is_floating_point:
        raise TypeError(f"{where} must return a floating-point loss, got {loss.dtype}")
    return loss


def check_loss_fn(loss_fn: Any, where: str) -> None:
    """``loss_fn`` callable, else a TypeError naming ``where``."""
    if not callable(loss_fn):
        raise TypeError(
            f"{where}: loss_fn must be a function (params, batch, mesh) -> this rank's scalar loss, such as lm_loss; "
            f"got {type(loss_fn).__name__}"
        )


def value_and_grad(loss_fn: LossFn) -> Callable[[dict, Any, Mesh], tuple[torch.Tensor, dict]]:
    """``f(params, batch, mesh) -> (loss, grads)``: the mean of every rank's ``loss_fn(params, batch, mesh)``
    and its gradient with respect to every float leaf of ``params``, each a shard in the leaf's layout.

    Collective: every rank of ``mesh`` calls it. Works eagerly and under ``torch.compile(fullgraph=True)``
    (:func:`functional_npu.runtime.training.train_step.compile_train_step` compiles it with an optimizer).

    Raises:
        TypeError / ValueError before any collective: params with no config, quantized, of mixed float dtypes or
        devices, or of another plan or mesh (naming the leaf); a batch of token ids or a PolicyBatch that the model
        cannot take (:mod:`.batch`); a ``loss_fn`` that returns no scalar floating-point tensor (naming its shape or
        type); a ``loss_fn`` that is not callable (at once, when ``value_and_grad`` is called).
    """

    check_loss_fn(loss_fn, "value_and_grad")

    def run(params: dict, batch: Any, mesh: Mesh) -> tuple[torch.Tensor, dict]:
        split = differentiable(params, mesh)
        check_batch(batch, split.placement.config.vocab_size, params["embed"].device, "value_and_grad")
        return grad_step(loss_fn, split, batch, mesh)

    return run


def grad_step(loss_fn: LossFn, split: Differentiable, batch: Any, mesh: Mesh) -> tuple[torch.Tensor, dict]:
    """The traced part of :func:`value_and_grad` (no checks): the mean loss and the whole gradients as a tree."""
    loss, whole = grad_leaves(loss_fn, split, split.leaves, batch, mesh)
    return loss, split.grads(whole)


def grad_leaves(
    loss_fn: LossFn,
    split: Differentiable,
    leaves: dict[str, torch.Tensor],
    batch: Any,
    mesh: Mesh,
    rest: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean loss over the ranks and the whole gradient of every leaf in ``leaves`` (by path), at ``leaves``;
    ``rest``: other tensor leaves in place of the split's (a compiled step passes both as its inputs)."""
    world = mesh.size

    def scaled(leaves: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        loss = check_loss(loss_fn(split.tree(leaves | (rest or {})), batch, mesh))
        return loss / world, loss.detach()

    g, (_, loss) = torch.func.grad_and_value(scaled, has_aux=True)(leaves)
    mean = all_reduce(loss, mesh, tuple(mesh.axis_names)) / world
    return mean, split.whole(g)


def global_norm(grads: dict[str, torch.Tensor], split: Differentiable) -> torch.Tensor:
    """The L2 norm of the whole gradient (``grads`` by path; every element once, however many ranks hold it), the
    same on every rank: each rank's sum of squares, each element weighted by one over its holder count, summed
    over the mesh."""
    device = next(iter(grads.values())).device
    total = torch.zeros(
        (), dtype=torch.float64 if _dtype(split.params) == torch.float64 else torch.float32, device=device
    )
    for p, g in grads.items():
        total = total + (g.to(total.dtype).pow(2) * _holder_weight(split.sums[p], split.mesh, g)).sum()
    return all_reduce(total, split.mesh, tuple(split.mesh.axis_names)).sqrt()


def _holder_weight(s: ReplicaSum, mesh: Mesh, g: torch.Tensor) -> torch.Tensor | float:
    """One over the number of ranks holding each element of ``g`` (broadcastable to ``g``)."""
    weight: torch.Tensor | float = 1.0 / math.prod([mesh.axis_size(a) for a in s.axes])
    for d, axes, copies in s.partial:
        count = [1] * g.shape[d]
        for start, length, _, _ in copies[mesh.axis_index(axes)]:
            for i in range(start, start + length):
                count[i] += 1
        shape = [1] * g.ndim
        shape[d] = g.shape[d]
        weight = weight * (1.0 / torch.tensor(count, dtype=g.dtype, device=g.device)).reshape(shape)
    return weight
