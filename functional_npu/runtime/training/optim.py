"""AdamW as a pure function over pytrees, with its state laid out like the params.

``opt = AdamW(lr=1e-4)``; ``state = opt.init(params)``; ``params, state = opt.update(params, grads, state, norm)``
returns new trees and leaves its inputs as they were (as optax does, not as ``torch.optim`` does). The state's
moments are trees of the params' structure, each leaf a shard of its param's shape, so they share the params'
layouts and reshard with them. The update is torch's ``AdamW`` (decoupled weight decay, bias-corrected moments)
after ``clip_grad_norm_``'s clipping by the global norm, element for element; the global norm is computed once
for the whole sharded gradient by :func:`functional_npu.runtime.training.grad.global_norm` (every element counted once,
however many ranks hold it) and passed in, so the update itself is rank-local and needs no collective.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ...core.params import Params
from ...core.tree import flatten_with_paths, map_with_path, replace_leaves

__all__ = ["AdamW", "OptState"]


class OptState(NamedTuple):
    """AdamW's state: the step count (a 0-dim int64 tensor) and the first and second moments, trees of the
    params' structure (``None`` where a leaf takes no gradient)."""

    step: torch.Tensor
    mu: dict
    nu: dict


def _number(value: Any, name: str, *, low: float = 0.0, below: float | None = None, open_low: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and (below is None or value < below)
    if not ok:
        bound = f"in ({low}, {below})" if below is not None else (f"> {low}" if open_low else f">= {low}")
        raise ValueError(f"AdamW: {name} must be a finite number {bound}, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamW:
    """AdamW with decoupled weight decay and gradient clipping by the global norm (torch's defaults).

    Attributes:
        lr: the learning rate (a finite number > 0).
        betas: the moments' decay rates, each in [0, 1).
        eps: added to the second moment's root (> 0).
        weight_decay: decoupled decay, ``p -= lr * weight_decay * p`` on every leaf (as ``torch.optim.AdamW`` with
            one parameter group).
        max_grad_norm: clip the gradient to this global norm first (``None``: no clipping).

    Raises:
        ValueError naming the field for a value that is not finite or out of range.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        _number(self.lr, "lr", open_low=True)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"AdamW: betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(_number(b, "betas", below=1.0) for b in self.betas))
        _number(self.eps, "eps", open_low=True)
        _number(self.weight_decay, "weight_decay")
        if self.max_grad_norm is not None:
            _number(self.max_grad_norm, "max_grad_norm", open_low=True)

    def init(self, params: dict, grads_of: set[str] | None = None) -> OptState:
        """Zero moments for every float leaf of ``params`` (or the paths in ``grads_of``), and step 0.

        Raises:
            TypeError / ValueError: params that are no dict, ``grads_of`` that is no set of paths or names a path that
            is no float leaf of ``params``, nothing to train.
        """
        trained = _float_paths(params, grads_of)

        def zeros(path: str, x: Any) -> Any:
            return torch.zeros_like(x) if path in trained else None

        mu = map_with_path(zeros, params)
        device = next(x.device for _, x in flatten_with_paths(mu) if isinstance(x, torch.Tensor))
        return OptState(torch.zeros((), dtype=torch.int64, device=device), mu, map_with_path(zeros, params))

    def clip_scale(self, norm: torch.Tensor) -> torch.Tensor | float:
        """What the gradient is multiplied by for a global norm ``norm``: ``clip_grad_norm_``'s coefficient.

        Raises:
            TypeError: ``norm`` is not a tensor. ValueError: a CPU ``norm`` that is negative, NaN or infinite (read
            outside tracing only: an accelerator's is not read, which would cost a device sync).
        """
        _check_norm(norm, "AdamW.clip_scale", finite=True)
        return self._scale(norm)

    def _scale(self, norm: torch.Tensor) -> torch.Tensor | float:
        if self.max_grad_norm is None:
            return 1.0
        return torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)

    def update(self, params: dict, grads: dict, state: OptState, norm: torch.Tensor) -> tuple[dict, OptState]:
        """One step: new params and state. ``grads``: a tree of the params' structure, as
        :func:`~.grad.value_and_grad` returns it (this rank's whole gradient shards);
        ``norm``: their global norm (:func:`~.grad.global_norm`). Pure: nothing passed in is
        modified.

        A non-finite gradient is not refused here (finding it would cost a device sync each step): it makes every
        param it reaches NaN, and with clipping every param (the global norm is NaN).
        :func:`~.train_step.compile_train_step` checks every leaf's finiteness in its graph and refuses such a step
        before returning anything; called by hand, check ``torch.isfinite(norm)`` before applying the result.

        Raises:
            ValueError naming the leaf: a gradient for a leaf the state has no moments for, a trained leaf with no
            gradient, a gradient of another shape than its param; a negative CPU ``norm``. TypeError: a ``norm`` that
            is not a tensor.
        """
        grads = check_grads(grads, params, state)
        _check_norm(norm, "AdamW.update", finite=False)
        b1, b2 = self.betas
        step = state.step + 1
        # bias corrections in the wider of float32 and the params' dtype: float64 params get torch.optim.AdamW's
        # exact ones, the others float32's (NPUs have no float64)
        wide = torch.float32
        for _, x in flatten_with_paths(params):  # a loop dynamo traces
            if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
                wide = torch.float64
        t = step.to(wide)
        c1, c2 = 1 - b1**t, 1 - b2**t
        scale = self._scale(norm)
        leaves, mu, nu = (dict(flatten_with_paths(t)) for t in (params, state.mu, state.nu))
        new_p, new_mu, new_nu = {}, {}, {}
        for path, g in grads.items():
            p, g = leaves[path], g * scale
            m = torch.lerp(mu[path], g, 1 - b1)  # b1 m + (1 - b1) g
            v = nu[path] * b2 + (1 - b2) * g * g
            denom = (v / c2.to(v.dtype)).sqrt() + self.eps
            new_p[path] = p * (1 - self.lr * self.weight_decay) - self.lr * (m / c1.to(m.dtype)) / denom
            new_mu[path], new_nu[path] = m, v
        moments = OptState(step, replace_leaves(state.mu, new_mu), replace_leaves(state.nu, new_nu))
        return replace_leaves(params, new_p), moments


def _check_norm(norm: Any, where: str, *, finite: bool) -> None:
    """``norm`` a tensor; read only on the CPU outside tracing (no device sync): >= 0, and finite if ``finite``."""
    if not isinstance(norm, torch.Tensor):
        raise TypeError(f"{where}: norm must be a 0-d tensor (global_norm's), got {type(norm).__name__}")
    if norm.device.type != "cpu" or torch.compiler.is_compiling():
        return
    if bool((norm < 0).any()) or (finite and not bool(norm.isfinite().all())):
        why = "; a NaN or infinite one comes from a non-finite gradient: skip that step, as compile_train_step does"
        raise ValueError(
            f"{where}: norm is {norm.tolist()}; a global norm is {'a finite' if finite else 'a'} number >= 0 "
            f"(global_norm's of the gradients){why if finite else ''}"
        )


def _float_paths(params: Any, grads_of: Any) -> set[str]:
    """The paths :meth:`AdamW.init` keeps moments for, checked (see its Raises)."""
    if not isinstance(params, (Mapping, Params)):
        raise TypeError(f"AdamW.init: params must be the params tree (a dict of tensors), got {type(params).__name__}")
    if grads_of is not None and (isinstance(grads_of, str) or not isinstance(grads_of, Collection)):
        raise TypeError(f"AdamW.init: grads_of must be a set of param paths (None: every float leaf), got {grads_of!r}")
    floats = {p for p, x in flatten_with_paths(params) if isinstance(x, torch.Tensor) and x.dtype.is_floating_point}
    unknown = sorted(set(grads_of or ()) - floats, key=str)
    if unknown:
        raise ValueError(
            f"AdamW.init: grads_of names {unknown[0]!r}, which is no floating-point leaf of params; name paths of "
            f"float leaves (as value_and_grad's gradient tree has them), or pass None for every float leaf"
        )
    chosen = floats if grads_of is None else set(grads_of)
    if not chosen:
        raise ValueError(
            f"AdamW.init: nothing to train: {'grads_of is empty' if floats else 'params hold no floating-point tensor'}"
            f"; pass the params tree (load_checkpoint's) and the paths of the leaves to train"
        )
    return chosen


def check_grads(grads: dict, params: dict, state: OptState) -> dict[str, torch.Tensor]:
    """``grads`` by path after checking them against the params and the state's moments (see :meth:`AdamW.update`)."""
    got = {p: g for p, g in flatten_with_paths(grads) if isinstance(g, torch.Tensor)}
    moments = {p for p, m in flatten_with_paths(state.mu) if isinstance(m, torch.Tensor)}
    leaves = dict(flatten_with_paths(params))
    extra, missing = sorted(set(got) - moments), sorted(moments - set(got))
    if extra or missing:
        which = f"grads[{extra[0]!r}] has no moments in the optimizer state" if extra else ""
        which = which or f"grads has no gradient for params[{missing[0]!r}], which the optimizer state trains"
        raise ValueError(
            f"AdamW.update: {which} ({len(extra)} extra, {len(missing)} missing); pass the gradient tree "
            f"value_and_grad returns for these params, and a state from AdamW.init of the same params"
        )
    unknown = sorted(set(got) - set(leaves))
    if unknown:
        raise ValueError(f"AdamW.update: grads[{unknown[0]!r}] is not a leaf of params; pass the params it trains")
    for p, g in got.items():
        if tuple(g.shape) != tuple(leaves[p].shape):
            raise ValueError(
                f"AdamW.update: grads[{p!r}] has shape {tuple(g.shape)} but params[{p!r}] has "
                f"{tuple(leaves[p].shape)}; were the gradients taken for params of another plan or mesh?"
            )
    return got
