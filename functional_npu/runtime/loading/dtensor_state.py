"""A training state of DTensors (FSDP2, optionally with TP) straight to an inference plan, in one exchange.

``from_dtensor_state(state, cfg, mesh)`` takes an HF model's ``state_dict()`` as FSDP2 holds it (each value a
DTensor on the training ``DeviceMesh``) and returns this rank's params for the family's plan on ``mesh``.
Each HF tensor's training placement is read as a layout (:mod:`functional_npu.core.dtensor`), its target is
the slice of the plan's leaf it forms (a fused leaf's block: ``q_proj`` in ``[q|k|v]``), and one
:func:`~functional_npu.reshard` moves every tensor at once: each rank receives only the bytes it needs and
does not hold, from one holder. Fused leaves are then joined locally, block by block.

The training mesh must cover the same ranks as ``mesh``, row-major, with axes that nest with ``mesh``'s: FSDP2
over the whole world, FSDP2 + TP on ``(dp_shard, tp)`` (its strided shards included) or HSDP on
``(dp_replicate, dp_shard)``, served at ``{"tp": 4}`` or ``{"dp": 2, "tp": 2}`` on the same four ranks. The
exchange runs on the coarsest mesh that refines both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...core.agree import agree
from ...core.dtensor import layout_from_dtensor, root_mesh
from ...core.dtypes import float_dtype
from ...core.layout import Cyclic, Layout
from ...core.mesh import Mesh
from ...core.params import Params
from ...core.reshard import ReshardPlan, plan_reshard, reshard
from ...core.tree import flatten_with_paths, map_with_path
from ...models import family_of
from ...parallel.layer_shard import present
from ...parallel.plan import Plan
from ...placement.hf_layout import fused_dim, stored_tensors
from ...placement.placement import Placement, place
from ...placement.ring_memory import warn_ring_memory

__all__ = ["from_dtensor_state"]


def from_dtensor_state(
    state: Mapping[str, Any],
    cfg: Any,
    mesh: Mesh,
    plan: Plan | None = None,
    *,
    dtype: torch.dtype | None = None,
    report: list | None = None,
) -> dict[str, Any]:
    """This rank's params for ``cfg`` under ``plan`` (default ``Plan()``) on ``mesh`` from a training ``state`` of
    DTensors (HF names).

    Collective: every rank of ``mesh`` calls it. ``report``: if a list, the :class:`ReshardPlan` is appended
    (its ``traffic`` gives each rank's bytes sent, received and the lower bound). ``dtype``: the params' floating
    dtype (default: the embedding's, so a state holding a stray bf16 tensor among fp32 ones comes out in one
    dtype, as :func:`~functional_npu.load_checkpoint` reads a checkpoint); each rank casts its
    shards before they move.

    Stacked experts come either as transformers' fused tensors (``mlp.experts.gate_up_proj``, the family's
    ``module_names``) or as one tensor per expert (the checkpoint's names), each expert placed alike.
    With ``plan.layer_shard`` the series are layer-sharded over its axis (as ``load_checkpoint`` does): each
    layer's tensor goes to its owner only, fetched ``plan.prefetch_step`` layers ahead by the compiled model.

    Raises:
        ValueError / TypeError before any byte moves, the same on every rank (the checks of each rank's state are
        agreed first, :func:`~functional_npu.core.agree.agree`): a name the family's table does not know or a
        missing one, a tensor that is not a DTensor or not floating point, a placement with no layout
        (``Partial``, uneven), a training mesh that does not nest with ``mesh``; ranks whose states differ in
        dtypes or placements.
    """
    try:
        x = _exchange(state, cfg, mesh, Plan() if plan is None else plan, dtype)
    except Exception as e:
        agree(mesh, e)
        raise  # agree raised already
    same = {
        "the params' dtype (the embedding's unless dtype= is given)": {k: v.dtype for k, v in x.local.items()},
        "the state's training layouts": x.src,
        "the plan's layouts": x.dst,
    }
    agree(mesh, None, same=same)
    warn_ring_memory(x.placement, "from_dtensor_state")
    if report is not None:
        report.append(x.program)
    moved = reshard(x.local, x.src, x.dst, x.on, plan=x.program)
    return _assemble(family_of(cfg), cfg, x.meta, x.targets, moved).placed(x.placement)


@dataclass(frozen=True, slots=True)
class _Exchange:
    """What one rank checked and planned before the exchange: the resolved plan and its leaves, the targets, this
    rank's tensor for each target (in the params' dtype), their training and plan layouts over the common mesh
    ``on``, and the exchange's plan."""

    placement: Placement
    meta: dict[str, Any]
    targets: dict[str, _Target]
    local: dict[str, torch.Tensor]
    src: dict[str, Layout]
    dst: dict[str, Layout]
    on: Mesh
    program: ReshardPlan


def _exchange(state: Mapping[str, Any], cfg: Any, mesh: Mesh, plan: Plan, dtype: torch.dtype | None) -> _Exchange:
    """Check this rank's ``state`` against ``cfg`` and ``plan`` and plan the exchange (nothing moves)."""
    family = family_of(cfg)
    dtype = None if dtype is None else float_dtype(dtype, "from_dtensor_state")
    placement = place(cfg, mesh, plan, where="from_dtensor_state")
    ls = placement.plan.layer_shard
    meta, layouts = placement.stored  # the per-layer form the state's names are in
    given = set(state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    targets = _targets(family, cfg, meta, layouts, given)
    if ls is not None:
        targets = _series(targets, present(ls, meta["layers"]), ls.axis, cfg.num_layers)
    meta = placement.meta
    known = {n for t in targets.values() for n in t.names}
    if known != given:
        raise ValueError(
            f"from_dtensor_state: the state does not match this {cfg.architecture} config: "
            f"missing {sorted(known - given)[:8]}, unknown {sorted(given - known)[:8]}"
        )
    dtype = dtype or _checked(state, targets)
    local, src, dst, common = {}, {}, {}, {}
    for key, t in targets.items():
        dts = [state[n] for n in t.names]
        root = root_mesh(dts[0], path=t.names[0])
        mesh_key = (tuple(root.mesh_dim_names), tuple(root.mesh.shape))
        if mesh_key not in common:
            common[mesh_key] = _common_mesh(mesh, root, t.names[0])
        if common[mesh_key][0].shape != next(iter(common.values()))[0].shape:
            raise ValueError(
                f"from_dtensor_state: {t.names[0]!r} is on training mesh {dict(zip(*mesh_key))}, which cuts the "
                f"ranks unlike the other tensors' training mesh; reshard one training mesh's state at a time"
            )
        _, runs, train_runs = common[mesh_key]
        placed = {(layout_from_dtensor(dt, path=n), tuple(root_mesh(dt).mesh.shape)) for n, dt in zip(t.names, dts)}
        if len(placed) > 1:
            raise ValueError(
                f"from_dtensor_state: the experts of {t.path} are placed differently ({sorted(map(repr, placed))}); "
                f"place every expert of a layer alike"
            )
        layout = placed.pop()[0]
        src[key] = _over(Layout((None, *layout.dims)) if t.stacked else layout, train_runs, key)
        dst[key] = _over(t.layout, runs, key)
        # a tied model's lm_head.weight is the embedding: unread
        local[key] = (torch.stack([dt.to_local() for dt in dts]) if t.stacked else dts[0].to_local()).to(dtype)
    on = next(iter(common.values()))[0]
    program = plan_reshard({k: (t.shape, dtype) for k, t in targets.items()}, src, dst, on)
    return _Exchange(placement, meta, targets, local, src, dst, on, program)


def _checked(state: Mapping[str, Any], targets: Mapping[str, _Target]) -> torch.dtype:
    """Check every tensor the targets read is a floating-point DTensor of the shape the config implies; returns the
    embedding's dtype (the params' dtype unless the caller asks for another)."""
    embed = torch.float32
    for t in targets.values():
        for name in t.names:
            dt = state[name]
            if not hasattr(dt, "placements"):
                raise TypeError(
                    f"from_dtensor_state: {name!r} is a {type(dt).__name__}, not a DTensor; pass the state_dict() "
                    f"of the FSDP2 / TP-wrapped model (or load a saved checkpoint with load_checkpoint)"
                )
            want = t.shape[1:] if t.stacked else t.shape
            if tuple(dt.shape) != want:
                raise ValueError(f"from_dtensor_state: {name!r} is {tuple(dt.shape)}, the config implies {want}")
            if not dt.dtype.is_floating_point:
                raise ValueError(
                    f"from_dtensor_state: {name!r} (for params[{t.path!r}]) is {dt.dtype}, but weights are floating "
                    f"point (torch.float32, torch.bfloat16, torch.float16, torch.float64); the state was not taken "
                    f"from this model's weights"
                )
            if t.path == "embed":
                embed = dt.dtype
    return embed


@dataclass(frozen=True, slots=True)
class _Target:
    """What one exchanged tensor is: the state's tensors it comes from (one, or one per expert stacked along a
    new dim 0), the leaf it is part of, its full shape, its slice of the leaf's plan, and the dim along which
    it joins the leaf's other parts."""

    names: tuple[str, ...]
    path: str
    shape: tuple[int, ...]
    layout: Layout
    dim: int
    stacked: bool = False


def _targets(family: Any, cfg: Any, meta: dict, layouts: dict[str, Layout], given: set[str]) -> dict[str, _Target]:
    """Exchange key -> :class:`_Target`, for every tensor of the plan's leaves under the names ``given`` uses."""
    leaves = dict(flatten_with_paths(meta))
    out = {}
    experts: dict[tuple[str, int], dict[int, tuple[str, Any]]] = {}
    for name, t in stored_tensors(family, cfg, leaves, layouts, given).items():
        if t.index is None:
            out[name] = _Target((name,), t.path, t.shape, t.layout, fused_dim(layouts[t.path]))
        else:
            experts.setdefault((t.path, t.block), {})[t.index] = (name, t)
    for (path, block), by_index in experts.items():
        names = tuple(by_index[j][0] for j in sorted(by_index))
        t = by_index[0][1]
        if len(names) != leaves[path].shape[0]:
            raise ValueError(
                f"from_dtensor_state: {path} has {leaves[path].shape[0]} expert slots for {len(names)} experts; "
                f"reshard without redundant slots, then place them (EPLB)"
            )
        lay = Layout((*(layouts[path].dims[:1] or (None,)), *t.layout.dims))  # _over drops trailing whole dims
        sub = Layout(layouts[path].dims[1:])
        out[f"{path}[{block}]"] = _Target(names, path, (len(names), *t.shape), lay, 1 + fused_dim(sub), True)
    return out


def _series(targets: dict[str, _Target], leaves: tuple[str, ...], axis: str, num_layers: int) -> dict[str, _Target]:
    """The targets with each series leaf's layers stacked into one target of its layer-sharded leaf
    (``series.<leaf>``, dim 0 ``Cyclic(axis, L)``): layer ``l`` goes to its owner alone."""
    out, stacks = {}, {}
    for key, t in targets.items():
        layer, _, leaf = t.path.partition(".")[2].partition(".")
        if t.path.startswith("layers.") and leaf in leaves:
            stacks.setdefault((leaf, t.names[0].replace(f".{layer}.", ".{i}.", 1)), {})[int(layer)] = t
        else:
            out[key] = t
    for (leaf, name), by_layer in stacks.items():
        t = by_layer[0]
        names = tuple(by_layer[i].names[0] for i in range(num_layers))
        layout = Layout((Cyclic(axis, num_layers), *t.layout.dims))
        out[f"series.{leaf}[{name}]"] = _Target(
            names, f"series.{leaf}", (num_layers, *t.shape), layout, 1 + t.dim, True
        )
    return out


def _common_mesh(mesh: Mesh, device_mesh: Any, name: str) -> tuple[Mesh, dict[str, tuple[str, ...]], dict]:
    """The coarsest mesh both ``mesh`` and the training ``device_mesh`` are coarsenings of (both row-major over the
    same ranks), with each axis of either as its run of the common mesh's axes: ``(common, runs of mesh's axes,
    runs of the training mesh's dims)``. A serving axis cut by a training boundary becomes ``tp``, ``tp_1``, ...
    (e.g. a ``(dp 2, tp 2)`` training mesh under a ``tp 4`` serving mesh)."""
    names, sizes = device_mesh.mesh_dim_names, [int(n) for n in device_mesh.mesh.shape]
    if device_mesh.mesh.flatten().tolist() != list(range(mesh.size)):
        raise ValueError(
            f"{name}: the training mesh {dict(zip(names, sizes))} does not hold ranks 0 .. {mesh.size - 1} in "
            f"row-major order; train and serve on the same world"
        )
    serve = [[a, n, 0] for a, n in zip(mesh.axis_names, mesh.axis_sizes)]  # axis, size left, pieces so far
    train = [[a, n] for a, n in zip(names, sizes)]
    common: list[tuple[str, str, int]] = []  # (serving axis, common axis name, size)
    runs: dict[str, list[str]] = {a: [] for a in mesh.axis_names}
    train_runs: dict[str, list[str]] = {a: [] for a in names}
    while serve or train:
        if train and train[0][1] == 1:
            train.pop(0)
            continue
        if serve and (serve[0][1] == 1 or not train):
            axis, left, k = serve.pop(0)
            if left == 1 and k == 0:  # a size-1 serving axis stays (nothing trains over it)
                common.append((axis, axis, 1))
                runs[axis].append(axis)
            continue
        if not serve:
            break
        (axis, left, k), (t_axis, t_left) = serve[0], train[0]
        step = min(left, t_left)
        if left % step or t_left % step:
            raise ValueError(
                f"{name}: training mesh axis {t_axis!r} (size {dict(zip(names, sizes))[t_axis]}) and serving mesh "
                f"axis {axis!r} (size {mesh.shape[axis]}) cut the ranks at different places: the training mesh "
                f"{dict(zip(names, sizes))} and the mesh {mesh.shape} do not nest; serve on a mesh whose axes "
                f"nest with the training mesh's"
            )
        piece = axis if k == 0 else f"{axis}_{k}"
        common.append((axis, piece, step))
        runs[axis].append(piece)
        train_runs[t_axis].append(piece)
        serve[0] = [axis, left // step, k + 1]
        train[0] = [t_axis, t_left // step]
    out = mesh
    for axis in mesh.axis_names:
        parts = [(p, n) for a, p, n in common if a == axis]
        if len(parts) > 1:
            out = out.split(axis, [p for p, _ in parts], [n for _, n in parts])
    return out, {a: tuple(r) for a, r in runs.items()}, {a: tuple(r) for a, r in train_runs.items()}


def _over(layout: Layout, runs: Mapping[str, tuple[str, ...]], name: str) -> Layout:
    """``layout`` with each axis replaced by its run of the common mesh's axes (a dim left with none is whole); a
    layer dim stays on its axis, which the training mesh must not cut."""
    dims: list[Any] = []
    for spec in layout.dims:
        if isinstance(spec, Cyclic):
            if runs[spec.axis] != (spec.axis,):
                raise ValueError(
                    f"from_dtensor_state: {name}: layers are sharded over mesh axis {spec.axis!r}, which the "
                    f"training mesh cuts in parts {runs[spec.axis]}; layer-shard over an axis it does not cut"
                )
            dims.append(spec)
        else:
            axes = () if spec is None else tuple(p for a in spec.axes for p in runs[a])
            dims.append(dataclasses.replace(spec, axes=axes) if axes else None)
    while dims and dims[-1] is None:
        dims.pop()
    return Layout(tuple(dims))


def _assemble(family: Any, cfg: Any, meta: Params, targets: Mapping[str, _Target], moved: dict) -> Params:
    """The params tree: each leaf its parts' local pieces, joined along their dim in block order."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, t in targets.items():
        pieces.setdefault(t.path, []).append((t.dim, moved[key]))

    def leaf(path: str, _: torch.Tensor) -> Any:
        if path not in pieces:  # a derived leaf (an expert map)
            return family.derived[path.rsplit(".", 1)[-1]](cfg)
        parts = pieces[path]
        return parts[0][1] if len(parts) == 1 else torch.cat([x for _, x in parts], dim=parts[0][0])

    return map_with_path(leaf, meta)
