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

import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ...core.agree import agree
from ...core.buckets import check_bucket_bytes
from ...core.layout import Layout
from ...core.mesh import Mesh
from ...core.params import Params
from ...core.reshard import ReshardPlan, Source, check_program, plan_reshard, run_buckets
from ...core.shard import full_shape
from ...core.tree import flatten_with_paths, map_with_path
from ...parallel.offload import pinned
from ...parallel.plan import Plan
from ...placement.placement import Placement, place, placement_of

__all__ = ["reshard_params", "plan_params_reshard"]

# the stacked leaves of a plan: a layer-sharded series (dim 0 cyclic) and a series kept in host memory (dim 0 whole)
_HEADS = ("series", "host")
_STACKED = tuple(f"{h}." for h in _HEADS)


def _every_layer(paths: Iterable[str], num_layers: int) -> set[str]:
    """Leaves every layer has, counting a layer-sharded series and one kept in host memory (``paths``: a plan's leaf
    paths)."""
    per_layer = Counter(p.split(".", 2)[2] for p in paths if p.startswith("layers."))
    series = {p.split(".", 1)[1] for p in paths if p.startswith(_STACKED)}
    return {leaf for leaf, n in per_layer.items() if n == num_layers} | series


def _stacked_layouts(layouts: dict[str, Layout], every: set[str]) -> dict[str, Layout]:
    """The plan's layouts by path in the stacked form (see the module docstring)."""
    out: dict[str, Layout] = {}
    for path, lay in layouts.items():
        head, _, rest = path.partition(".")
        if head in _HEADS:
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


def _stacked(params: dict, every: set[str]) -> tuple[dict[str, torch.Tensor], Source]:
    """This rank's leaves in the stacked form: meta tensors of their shapes and dtypes (nothing copied), and the
    source that gives one leaf's tensor or its dim-0 rows (a per-layer leaf stacked when asked, only the layers
    asked for, not kept)."""
    shapes: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    per_layer: dict[str, list[torch.Tensor]] = {}
    for path, x in flatten_with_paths(params):
        if not isinstance(x, torch.Tensor):
            continue
        head, _, rest = path.partition(".")
        leaf = rest.partition(".")[2]
        if head in _HEADS:
            tensors[f"stack.{rest}"] = x
        elif head == "layers" and leaf in every:
            per_layer.setdefault(leaf, []).append(x)
        else:
            tensors[path] = x
    for path, x in tensors.items():
        shapes[path] = torch.empty(x.shape, dtype=x.dtype, device="meta")
    for leaf, xs in per_layer.items():
        shapes[f"stack.{leaf}"] = torch.empty((len(xs), *xs[0].shape), dtype=xs[0].dtype, device="meta")

    def source(path: str, rows: tuple[int, int] | None) -> torch.Tensor:
        if path in tensors:
            return tensors[path] if rows is None else tensors[path].narrow(0, *rows)
        layers = per_layer[path.removeprefix("stack.")]
        return torch.stack(layers if rows is None else layers[rows[0] : rows[0] + rows[1]])

    return shapes, source


def _keep(out: dict[str, torch.Tensor], per_layer: set[str]) -> Callable[[str, torch.Tensor], None]:
    """Where each destination leaf goes as it is made: a stacked leaf the destination keeps per layer is cut into
    one tensor per layer (``layers.{i}.leaf``) at once, so only one stacked leaf is held beyond the result."""

    def done(path: str, x: torch.Tensor) -> None:
        leaf = path.removeprefix("stack.")
        if path.startswith("stack.") and leaf in per_layer:
            for i in range(x.shape[0]):
                out[f"layers.{i}.{leaf}"] = x[i].clone()
        else:
            out[path] = x

    return done


def _unstacked(moved: dict[str, torch.Tensor], full: Params, every: set[str]) -> Params:
    """The tensors of ``full``'s structure (the destination plan's meta tree) from the moved leaves."""

    def pick(path: str, _: Any) -> torch.Tensor:
        head, _, rest = path.partition(".")
        if head == "host":  # kept in host memory, pinned where the params' device has it
            return pinned(moved[f"stack.{rest}"], moved[f"stack.{rest}"].device)
        return moved[f"stack.{rest}"] if head == "series" else moved[path]

    return map_with_path(pick, full)


def plan_params_reshard(
    params: dict, plan: Plan | Placement, mesh: Mesh, *, bucket_bytes: int | None = None
) -> ReshardPlan:
    """The exchange :func:`reshard_params` runs (pure: ``plan.traffic`` holds every rank's bytes and lower bound,
    ``plan.bucket_paths`` its buckets; pass it back as ``exchange`` to run it without planning again)."""
    return _prepared(params, plan, mesh, None, bucket_bytes)[0]


def _target(source: Placement, mesh: Mesh, plan: Plan | Placement, where: str) -> Placement:
    """The placement to move to: ``plan`` placed on the params' config, or a given placement of that config."""
    if isinstance(plan, Placement):
        _same_config(source.config, plan.config, where)
        plan.fits(mesh, where)
        return plan
    return place(source.config, mesh, plan, where=where)


def _same_config(mine: Any, theirs: Any, where: str) -> None:
    """Refuse a target placed on another model config, naming every field that differs."""
    if type(theirs) is not type(mine):
        diff = [f"a {type(theirs).__name__} (the params: a {type(mine).__name__})"]
    else:
        diff = [
            f"{f.name}={getattr(theirs, f.name)!r} (the params: {getattr(mine, f.name)!r})"
            for f in dataclasses.fields(mine)
            if getattr(theirs, f.name) != getattr(mine, f.name)
        ]
    if diff:
        raise ValueError(
            f"{where}: the target placement is for another model than the params: {'; '.join(diff[:6])}"
            f"{' ...' if len(diff) > 6 else ''}; place the inference plan on the params' config "
            f"(place(params.config, mesh, plan)) or pass the Plan itself"
        )


def _renamed(e: ValueError, where: str) -> ValueError:
    """The core's message for the stacked form, in this function's terms (``stack.o_proj``: every layer's)."""
    text = str(e).replace("reshard:", f"{where}:", 1)
    text, layer = re.subn(r"one dim-0 row of leaf 'stack\.([^']+)'", r"one layer of leaf 'layers.*.\1'", text)
    if layer:
        text = text.replace(
            "along dim 0 no finer than one row", "every layer has no finer than one layer (a row of it stacked)"
        )
    text = re.sub(r"leaf 'stack\.([^']+)'", r"leaf 'layers.*.\1' (every layer's, stacked)", text)
    return ValueError(text)


def _prepared(
    params: dict, plan: Plan | Placement, mesh: Mesh, exchange: ReshardPlan | None, bucket_bytes: int | None
) -> tuple[ReshardPlan, Source, dict, set[str], Placement, set[str]]:
    where = "reshard_params"
    try:
        if not isinstance(plan, (Plan, Placement)):
            raise TypeError(f"{where}: plan must be a functional_npu.Plan or a Placement, got {type(plan).__name__}")
        check_bucket_bytes(bucket_bytes, where)
        if exchange is not None and not isinstance(exchange, ReshardPlan):
            raise TypeError(
                f"{where}: exchange must be the ReshardPlan plan_params_reshard returns (or None: planned here), got "
                f"{type(exchange).__name__}"
            )
        source = placement_of(params, mesh, where=where)
        _check_leaves(params, source, where)
        if source.quant is not None:
            raise ValueError(f"{where}: params are quantized ({source.quant}); reshard floating-point params")
        target = _target(source, mesh, plan, where)
        if exchange is not None and bucket_bytes is not None and exchange.bucket_bytes != bucket_bytes:
            raise ValueError(
                f"{where}: the exchange was planned with bucket_bytes={exchange.bucket_bytes}, but "
                f"bucket_bytes={bucket_bytes} was given; plan again with it, or leave it out"
            )
        cfg, src_layouts, dst_layouts = source.config, source.layouts, target.layouts
        every = _every_layer(src_layouts, cfg.num_layers) & _every_layer(dst_layouts, cfg.num_layers)
        shapes, take = _stacked(params, every)
        src, dst = _stacked_layouts(src_layouts, every), _stacked_layouts(dst_layouts, every)
        if exchange is None:
            full = {p: (full_shape(p, x, src[p], mesh), x.dtype) for p, x in shapes.items()}
            try:
                exchange = plan_reshard(full, src, dst, mesh, bucket_bytes=bucket_bytes)
            except ValueError as e:
                raise _renamed(e, where) from None
        check_program(exchange, mesh.rank, shapes, src, dst)
    except (TypeError, ValueError) as e:
        agree(mesh, e)
        raise  # agree raised already
    # every rank moves its params to the same plan in the same buckets, or none moves a byte (a difference aborts
    # inside gloo, or leaves ranks waiting on an exchange the others never start)
    same = {"the target plan": {"plan": repr(target.plan)}, "the source": {"plan": repr(source.plan)}}
    same["the buckets"] = {"bucket_bytes": repr(exchange.bucket_bytes)}
    agree(mesh, None, same=same)
    per_layer = {p.split(".", 2)[2] for p in dst_layouts if p.startswith("layers.")} & every
    return exchange, take, target.meta, every, target, per_layer


def _check_leaves(params: dict, source: Placement, where: str) -> None:
    """Every tensor leaf is one the placement lays out, and holds data (not the meta device's shapes alone)."""
    for path, x in flatten_with_paths(params):
        if not isinstance(x, torch.Tensor):
            continue
        if path not in source.layouts:
            raise ValueError(
                f"{where}: params[{path!r}] is not a leaf of the {source.config.architecture} placement the params "
                f"carry; reshard the params the loader or a train step gave, without extra leaves"
            )
        if x.is_meta:
            raise ValueError(
                f"{where}: params[{path!r}] is on the meta device (a shape without data); reshard params that hold "
                f"their weights"
            )


def reshard_params(
    params: dict,
    plan: Plan | Placement,
    mesh: Mesh,
    *,
    exchange: ReshardPlan | None = None,
    bucket_bytes: int | None = None,
) -> Params:
    """This rank's params under ``plan`` from its params under their own plan, on the same ``mesh``.

    Collective: every rank of ``mesh`` calls it with the same plan. Pure: a new tree, never aliasing ``params``.

    Args:
        params: this rank's :class:`~functional_npu.core.params.Params`, placed (from ``load_checkpoint``, or a
            train step's output).
        plan: the plan to move them to, over axes of ``mesh`` (an inference plan over the training plan's
            data-parallel axis: ``Plan(tp="dp")``), or that plan already placed on the params' config.
        mesh: the mesh both plans run on.
        exchange: the exchange :func:`plan_params_reshard` planned for these params (else planned here).
        bucket_bytes: the most bytes a rank's send plus receive buffers take at once: the leaves (a leaf every
            layer has counts once, stacked over the layers) move in buckets, each unpacked before the next is
            packed, a leaf too big for a bucket in slabs of whole layers (rows of its dim 0), so the extra memory
            of the sync is at most one bucket, plus one stacked destination leaf where the plan keeps it per layer,
            plus the layers of one slab stacked where the params hold them per layer (``None``: one exchange of
            everything).

    Raises:
        TypeError / ValueError naming the leaf, before any byte moves: params of another plan or mesh than they
        say, quantized params, a plan that does not fit the model or the mesh, a placement of another model config
        (naming the fields that differ), a ``bucket_bytes`` that is not positive or is below what one layer of a
        leaf takes.

    Example:
        >>> serving = reshard_params(trained, Plan(tp="dp"), mesh, bucket_bytes=64 << 20)       # doctest: +SKIP
    """
    rp, take, dst_full, every, target, per_layer = _prepared(params, plan, mesh, exchange, bucket_bytes)
    moved: dict[str, torch.Tensor] = {}
    device = next((x.device for _, x in flatten_with_paths(params) if isinstance(x, torch.Tensor)), None)
    run_buckets(rp, mesh, take, _keep(moved, per_layer), device or torch.device("cpu"))
    return Params(_unstacked(moved, dst_full, every).tree, placement=target)
