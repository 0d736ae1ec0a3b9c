"""Params of one plan to params of another on the same ranks: the train-to-inference step of a post-training loop.

``reshard_params(params, plan, mesh)`` takes this rank's params under their own plan (their placement's: a
training plan, say data parallel with every layer's weights layer-sharded) and returns them under ``plan`` (an
inference plan, say tensor parallel over the same axis), with one planned exchange
(:func:`~functional_npu.core.reshard.reshard`: each rank receives only the bytes it needs and does not hold,
each from one holder). The two plans may place layers differently (a layer-sharded series is a stacked leaf
``series.o_proj`` whose dim 0 is cyclic over an axis; a plan without it keeps ``layers.3.o_proj``), so both
sides are first seen in one form: every leaf that every layer has, stacked over the layers (``stack.o_proj``,
``[L, ...]`` or the owned ``[L / n, ...]``), the rest as they are. Both plans run on one mesh: an inference plan
over the training plan's data-parallel axis names it (``Plan(tp="dp")``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from ...core.agree import agree
from ...core.layout import Layout
from ...core.mesh import Mesh
from ...core.reshard import ReshardPlan, plan_reshard, reshard
from ...core.shard import full_shape
from ...core.tree import flatten_with_paths, map_with_path
from ...parallel.plan import Plan
from ...placement.placement import Placement, place, placement_of

__all__ = ["reshard_params", "plan_params_reshard"]


def _every_layer(paths: Iterable[str], num_layers: int) -> set[str]:
    """Leaves every layer has, counting a layer-sharded series (``paths``: a plan's leaf paths)."""
    per_layer = Counter(p.split(".", 2)[2] for p in paths if p.startswith("layers."))
    series = {p.split(".", 1)[1] for p in paths if p.startswith("series.")}
    return {leaf for leaf, n in per_layer.items() if n == num_layers} | series


def _stacked_layouts(layouts: dict[str, Layout], every: set[str]) -> dict[str, Layout]:
    """The plan's layouts by path in the stacked form (see the module docstring)."""
    out: dict[str, Layout] = {}
    for path, lay in layouts.items():
        head, _, rest = path.partition(".")
        if head == "series":
            out[f"stack.{rest}"] = lay
        elif head == "layers" and rest.partition(".")[2] in every:
            i, _, leaf = rest.partition(".")
            stacked = Layout((None,) + lay.dims)
            if out.setdefault(f"stack.{leaf}", stacked) != stacked:
                raise ValueError(
                    f"reshard_params: layers of {leaf!r} have different layouts ({lay} at layer {i}); "
                    f"layouts that differ by layer are not stacked"
                )
        else:
            out[path] = lay
    return out


def _stacked(params: dict, every: set[str]) -> dict[str, torch.Tensor]:
    """This rank's tensors by path in the stacked form."""
    out: dict[str, torch.Tensor] = {}
    per_layer: dict[str, list[torch.Tensor]] = {}
    for path, x in flatten_with_paths(params):
        if not isinstance(x, torch.Tensor):
            continue
        head, _, rest = path.partition(".")
        leaf = rest.partition(".")[2]
        if head == "series":
            out[f"stack.{rest}"] = x
        elif head == "layers" and leaf in every:
            per_layer.setdefault(leaf, []).append(x)
        else:
            out[path] = x
    return out | {f"stack.{leaf}": torch.stack(xs) for leaf, xs in per_layer.items()}


def _unstacked(stacked: dict[str, torch.Tensor], full: dict, every: set[str]) -> dict[str, Any]:
    """The tensors of ``full``'s structure (the destination plan's meta tree) from the stacked form."""

    def pick(path: str, _: Any) -> torch.Tensor:
        head, _, rest = path.partition(".")
        i, _, leaf = rest.partition(".")
        if head == "series":
            return stacked[f"stack.{rest}"]
        if head == "layers" and leaf in every:
            return stacked[f"stack.{leaf}"][int(i)].clone()
        return stacked[path]

    return map_with_path(pick, full)


def plan_params_reshard(params: dict, plan: Plan, mesh: Mesh) -> ReshardPlan:
    """The exchange :func:`reshard_params` runs (pure: ``plan.traffic`` holds every rank's bytes and lower bound;
    pass it back as ``exchange`` to run it without planning again)."""
    return _prepared(params, plan, mesh, None)[0]


def _prepared(
    params: dict, plan: Plan, mesh: Mesh, exchange: ReshardPlan | None
) -> tuple[ReshardPlan, dict, dict, dict, dict, set[str], Placement]:
    where = "reshard_params"
    try:
        if not isinstance(plan, Plan):
            raise TypeError(f"{where}: plan must be a functional_npu.Plan, got {type(plan).__name__}")
        source = placement_of(params, mesh, where=where)
        if source.quant is not None:
            raise ValueError(f"{where}: params are quantized ({source.quant}); reshard floating-point params")
        target = place(source.config, mesh, plan, where=where)
    except (TypeError, ValueError) as e:
        agree(mesh, e)
        raise  # agree raised already
    # every rank moves its params to the same plan, or none moves a byte (a difference aborts inside gloo)
    agree(mesh, None, same={"the target plan": {"plan": repr(target.plan)}, "the source": {"plan": repr(source.plan)}})
    cfg, src_layouts = source.config, source.layouts
    dst_full, dst_layouts = target.meta, target.layouts
    every = _every_layer(src_layouts, cfg.num_layers) & _every_layer(dst_layouts, cfg.num_layers)
    local = _stacked(params, every)
    src, dst = _stacked_layouts(src_layouts, every), _stacked_layouts(dst_layouts, every)
    if exchange is None:
        shapes = {p: (full_shape(p, x, src[p], mesh), x.dtype) for p, x in local.items()}
        exchange = plan_reshard(shapes, src, dst, mesh)
    return exchange, local, src, dst, dst_full, every, target


def reshard_params(params: dict, plan: Plan, mesh: Mesh, *, exchange: ReshardPlan | None = None) -> dict:
    """This rank's params under ``plan`` from its params under their own plan, on the same ``mesh``.

    Collective: every rank of ``mesh`` calls it with the same plan. Pure: a new tree, never aliasing ``params``.

    Args:
        params: this rank's params with ``params["config"]`` and their placement ``params["placement"]`` (from
            ``load_checkpoint``, or a train step's output).
        plan: the plan to move them to, over axes of ``mesh`` (an inference plan over the training plan's
            data-parallel axis: ``Plan(tp="dp")``).
        mesh: the mesh both plans run on.
        exchange: the exchange :func:`plan_params_reshard` planned for these params (else planned here).

    Raises:
        TypeError / ValueError naming the leaf, before any byte moves: params of another plan or mesh than they
        say, quantized params, a plan that does not fit the model or the mesh.

    Example:
        >>> serving = reshard_params(trained, Plan(tp="dp"), mesh)        # doctest: +SKIP
    """
    rp, local, src, dst, dst_full, every, target = _prepared(params, plan, mesh, exchange)
    moved = reshard(local, src, dst, mesh, plan=rp)
    return _unstacked(moved, dst_full, every) | {"config": params["config"], "placement": target}
