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
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

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
        """Zero moments for every float leaf of ``params`` (or the paths in ``grads_of``), and step 0."""

        def zeros(path: str, x: Any) -> Any:
            trained = isinstance(x, torch.Tensor) and x.dtype.is_floating_point
            return torch.zeros_like(x) if trained and (grads_of is None or path in grads_of) else None

        mu = map_with_path(zeros, params)
        device = next(x.device for _, x in flatten_with_paths(mu) if isinstance(x, torch.Tensor))
        return OptState(torch.zeros((), dtype=torch.int64, device=device), mu, map_with_path(zeros, params))

    def clip_scale(self, norm: torch.Tensor) -> torch.Tensor | float:
        """What the gradient is multiplied by for a global norm ``norm``: ``clip_grad_norm_``'s coefficient."""
        if self.max_grad_norm is None:
            return 1.0
        return torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)

    def update(self, params: dict, grads: dict, state: OptState, norm: torch.Tensor) -> tuple[dict, OptState]:
        """One step: new params and state. ``grads``: a tree of the params' structure, as
        :func:`~.grad.value_and_grad` returns it (this rank's whole gradient shards);
        ``norm``: their global norm (:func:`~.grad.global_norm`). Pure: nothing passed in is
        modified.

        Raises:
            ValueError naming the leaf: a gradient for a leaf the state has no moments for, a trained leaf with no
            gradient, a gradient of another shape than its param.
        """
        grads = check_grads(grads, params, state)
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
        scale = self.clip_scale(norm)
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
