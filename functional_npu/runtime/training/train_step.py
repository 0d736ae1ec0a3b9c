"""A compiled train step: forward, backward and the optimizer update traced whole.

``step = compile_train_step(loss_fn, AdamW(lr=1e-4), params, mesh)`` checks the params once (a model config,
floating-point weights of this plan and mesh) and compiles one function with ``torch.compile(fullgraph=True)``:
:func:`~.grad.grad_leaves` (the sharded forward differentiated with ``torch.func``, every
collective by its transpose, replicated shares summed by their layouts), the global gradient norm, one
``all_reduce`` of every leaf's finiteness, and :meth:`AdamW.update <.optim.AdamW.update>`.
Every trained leaf, the optimizer's moments and the step count are the graph's inputs, so one compiled graph
serves every step.

``params, state, stats = step(params, state, batch)`` returns new params and state and leaves the ones passed
in as they were. A non-finite loss or gradient raises ``FloatingPointError`` naming the value or the first
leaf (the same on every rank: the flags are reduced over the mesh) before anything is returned, so the
caller's params and state are those of the last good step.

Example:
    >>> step = compile_train_step(lm_loss, AdamW(lr=1e-4), params, mesh)     # doctest: +SKIP
    >>> state = step.init(params)                                             # doctest: +SKIP
    >>> params, state, stats = step(params, state, tokens)                    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ...core.collectives import all_reduce
from ...core.mesh import Mesh
from ...core.tree import flatten_with_paths, replace_leaves
from ..serving.backends import Backend, resolve_backend
from ..serving.compile_policy import invariant_options
from ..serving.compiled_model import GraphBreakError
from ..serving.inductor_cache import sweep
from .batch import check_batch
from .grad import Differentiable, LossFn, check_loss_fn, differentiable, global_norm, grad_leaves
from .optim import AdamW, OptState

__all__ = ["compile_train_step", "TrainStep", "StepStats"]


class StepStats(NamedTuple):
    """What one step measured: the mean loss over the ranks and the global gradient norm before clipping."""

    loss: float
    grad_norm: float


@dataclass(frozen=True)
class TrainStep:
    """A compiled train step over one plan and mesh (:func:`compile_train_step`)."""

    optimizer: AdamW
    mesh: Mesh
    backend: Backend
    split: Differentiable  # its tensors on the meta device: shapes and structure only
    fn: Callable[..., Any]  # the compiled step
    plain: Callable[..., Any]  # the same step uncompiled: run once to say what a failed trace met

    def init(self, params: dict) -> OptState:
        """The optimizer state for ``params``: zero moments laid out like the params, step 0."""
        self._leaves(params)
        return self.optimizer.init(params, set(self.split.leaves))

    def __call__(self, params: dict, state: OptState, batch: Any) -> tuple[dict, OptState, StepStats]:
        """One step on this rank's ``batch``: ``(new params, new state, stats)``; collective over the mesh.

        Raises:
            ValueError naming the leaf: params or state of another structure or shape than the step's.
            TypeError / ValueError naming what is wrong with a batch of token ids or a PolicyBatch (its type, shape,
            dtype, device, an id outside the vocabulary, an empty mask; :mod:`.batch`).
            FloatingPointError naming the value or the leaf: a non-finite loss or gradient (nothing is returned;
            the params and state passed in are unchanged).
            The loss function's own error where tracing it fails on one (a non-scalar loss); else GraphBreakError.
        """
        args = self.inputs(params, state, batch)
        embed = args[0]["embed"] if "embed" in args[0] else args[1]["embed"]
        check_batch(batch, self.split.placement.config.vocab_size, embed.device, "train step")
        try:
            loss, norm, bad, new, new_mu, new_nu, count = self.fn(*args)
        except torch._dynamo.exc.Unsupported as e:
            self.plain(*args)  # the loss's own error, if it raises one
            raise GraphBreakError(f"train step: the step breaks under fullgraph tracing: {e}") from e
        paths = list(args[0])
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"train step {int(state.step) + 1}: the loss is {loss.item()}; the params and optimizer state are "
                f"those of the last step (lower the learning rate, or check the batch)"
            )
        if bad.any():
            leaf = paths[int(bad.nonzero()[0])]
            raise FloatingPointError(
                f"train step {int(state.step) + 1}: the gradient of params[{leaf!r}] is not finite (global norm "
                f"{norm.item()}); the step was not applied: the params and optimizer state are those of the last step"
            )
        out_state = OptState(count, replace_leaves(state.mu, new_mu), replace_leaves(state.nu, new_nu))
        return replace_leaves(params, new), out_state, StepStats(loss.item(), norm.item())

    def inputs(self, params: dict, state: OptState, batch: Any) -> tuple[Any, ...]:
        """The compiled function's arguments for one step, checked: ``(trained leaves, other tensor leaves,
        first moments, second moments, step count, batch)``, the leaves and moments by path."""
        return (*self._leaves(params), *self._moments(state), state.step, batch)

    def _leaves(self, params: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The trained leaves and every other tensor leaf (buffers, expert maps) of ``params``, checked."""
        got = {p: x for p, x in flatten_with_paths(params) if isinstance(x, torch.Tensor)}
        for path, want in self.split.leaves.items():
            x = got.get(path)
            if x is None or x.shape != want.shape or x.dtype != want.dtype:
                seen = "missing" if x is None else f"{tuple(x.shape)} {x.dtype}"
                raise ValueError(
                    f"train step: params[{path!r}] is {seen}, but the step was compiled for {tuple(want.shape)} "
                    f"{want.dtype} on mesh {self.mesh.shape}; pass params of the same plan and mesh"
                )
        leaves = {p: got[p].detach() for p in self.split.leaves}
        return leaves, {p: x for p, x in got.items() if p not in leaves}

    def _moments(self, state: OptState) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if not isinstance(state, OptState):
            raise TypeError(
                f"train step: state must be the OptState step.init(params) returns, got {type(state).__name__}"
            )
        mu, nu = ({p: x for p, x in flatten_with_paths(t) if isinstance(x, torch.Tensor)} for t in (state.mu, state.nu))
        for name, moments in (("mu", mu), ("nu", nu)):
            for path, want in self.split.leaves.items():
                if path not in moments or moments[path].shape != want.shape:
                    raise ValueError(
                        f"train step: state.{name}[{path!r}] is missing or of another shape than params[{path!r}] "
                        f"{tuple(want.shape)}; make the state with step.init(params)"
                    )
        return mu, nu


def compile_train_step(
    loss_fn: LossFn,
    optimizer: AdamW,
    params: dict,
    mesh: Mesh,
    *,
    backend: str = "auto",
    mode: str | None = None,
) -> TrainStep:
    """Compile forward, backward and ``optimizer``'s update into one step for params of this plan on ``mesh``.

    Args:
        loss_fn: ``(params, batch, mesh) -> this rank's scalar loss`` (e.g. :func:`.grad.lm_loss`); the step
            minimizes the mean over the ranks (:func:`~functional_npu.runtime.training.grad.value_and_grad`).
        optimizer: an :class:`~functional_npu.runtime.training.optim.AdamW`.
        params: this rank's params (``load_checkpoint``), floating-point, with their config and placement.
        mesh: the mesh they are sharded over.
        backend, mode: the compiler (:func:`~functional_npu.runtime.serving.resolve_backend`; ``"none"``: eager).

    Raises:
        TypeError / ValueError before any compile or collective: params with no config, quantized, or of another
        plan or mesh (naming the leaf); a ``loss_fn`` that is not callable; an optimizer that is not an AdamW.
    """
    check_loss_fn(loss_fn, "compile_train_step")
    if not isinstance(optimizer, AdamW):
        raise TypeError(f"compile_train_step: optimizer must be an AdamW, got {type(optimizer).__name__}")
    split = differentiable(params, mesh, "compile_train_step").skeleton()  # holds no tensor of ``params``
    chosen = resolve_backend(backend, mode=mode, device_type=params["embed"].device.type)
    if chosen.name == "inductor":
        sweep()
    if not mesh.is_abstract:
        mesh.init_groups()
        mesh.init_groups(*split.placement.axis_groups(), *split.axes())
    exact = invariant_options(params, split.placement, chosen, "compile_train_step")  # Plan.invariant's flags
    plain = _step_fn(loss_fn, optimizer, split, mesh)
    compiled = chosen.compile(plain, dynamic=False, inductor_options=exact)
    return TrainStep(optimizer, mesh, chosen, split, compiled, plain)


def _step_fn(loss_fn: LossFn, optimizer: AdamW, split: Differentiable, mesh: Mesh) -> Callable[..., Any]:
    every = tuple(mesh.axis_names)

    def step(leaves, rest, mu, nu, count, batch):
        loss, whole = grad_leaves(loss_fn, split, leaves, batch, mesh, rest)
        norm = global_norm(whole, split)
        finite = torch.stack([torch.isfinite(whole[p]).all() for p in leaves])
        bad = all_reduce((~finite).to(torch.float32), mesh, every, "max") > 0  # one verdict on every rank
        state = OptState(count, split.grads(mu), split.grads(nu))
        params, state = optimizer.update(split.tree(leaves | rest), split.grads(whole), state, norm)
        new = {p: x for p, x in flatten_with_paths(params) if p in leaves}
        moments = ({p: x for p, x in flatten_with_paths(t) if p in leaves} for t in (state.mu, state.nu))
        return loss, norm, bad, new, *moments, state.step

    return step
