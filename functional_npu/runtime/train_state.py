"""A training state of DTensors (FSDP2, optionally with TP) straight to an inference plan, in one exchange.

``from_dtensor_state(state, cfg, mesh)`` takes an HF model's ``state_dict()`` as FSDP2 holds it (each value a
DTensor on the training ``DeviceMesh``) and returns this rank's params for the family's plan on ``mesh``.
Each HF tensor's training placement is read as a layout (:mod:`functional_npu.core.dtensor`), its target is
the slice of the plan's leaf it forms (a fused leaf's block: ``q_proj`` in ``[q|k|v]``), and one
:func:`~functional_npu.reshard` moves every tensor at once: each rank receives only the bytes it needs and
does not hold, from one holder. Fused leaves are then joined locally, block by block.

The training mesh must cover the same ranks as ``mesh``, its axes a coarsening of ``mesh``'s in row-major
order (FSDP2 over the whole world, or ``(dp_shard, tp)`` over a ``{"dp", "tp"}`` mesh of the same sizes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..core.dtensor import layout_from_dtensor
from ..core.layout import Layout, Shard
from ..core.mesh import Mesh
from ..core.reshard import plan_reshard, reshard
from ..core.tree import flatten_with_paths, map_with_path
from ..models import family_of
from .hf_layout import fused_dim, stored_tensors
from .plan import check_plan

__all__ = ["from_dtensor_state"]


def from_dtensor_state(
    state: Mapping[str, Any], cfg: Any, mesh: Mesh, *, tp_axis: str = "tp", report: list | None = None
) -> dict[str, Any]:
    """This rank's params for ``cfg``'s plan on ``mesh`` from a training ``state`` of DTensors (HF names).

    Collective: every rank of ``mesh`` calls it. ``report``: if a list, the :class:`ReshardPlan` is appended
    (its ``traffic`` gives each rank's bytes sent, received and the lower bound).

    Raises:
        ValueError before any byte moves: a name the family's table does not know or a missing one, a
        placement with no layout (``Partial``, uneven), a training mesh that is not a coarsening of ``mesh``.
    """
    family = family_of(cfg)
    meta, layouts = check_plan(cfg, mesh, where="from_dtensor_state", tp_axis=tp_axis)
    targets = _targets(family, cfg, meta, layouts)
    known, given = set(targets), set(state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if known != given:
        raise ValueError(
            f"from_dtensor_state: the state does not match this {cfg.architecture} config: "
            f"missing {sorted(known - given)[:8]}, unknown {sorted(given - known)[:8]}"
        )
    local, src, dst = {}, {}, {}
    for name, (_, _, layout) in targets.items():
        dt = state[name]
        if tuple(dt.shape) != targets[name][1]:
            raise ValueError(
                f"from_dtensor_state: {name!r} is {tuple(dt.shape)}, the config implies {targets[name][1]}"
            )
        src[name] = _on(layout_from_dtensor(dt, path=name), dt.device_mesh, mesh, name)
        local[name], dst[name] = dt.to_local(), layout  # a tied model's lm_head.weight is the embedding: unread
    plan = plan_reshard({n: (targets[n][1], state[n].dtype) for n in targets}, src, dst, mesh)
    if report is not None:
        report.append(plan)
    moved = reshard(local, src, dst, mesh, plan=plan)
    return _assemble(family, cfg, meta, layouts, targets, moved)


def _targets(family: Any, cfg: Any, meta: dict, layouts: dict[str, Layout]) -> dict[str, tuple[str, tuple, Layout]]:
    """HF name -> (param path, full shape, the layout of its slice of the leaf)."""
    out = {}
    for name, t in stored_tensors(family, cfg, dict(flatten_with_paths(meta)), layouts).items():
        if t.index is not None:
            raise ValueError(f"from_dtensor_state: stacked experts ({t.path}) are not supported yet")
        out[name] = (t.path, t.shape, t.layout)
    return out


def _on(layout: Layout, device_mesh: Any, mesh: Mesh, name: str) -> Layout:
    """``layout`` (over the training mesh's dims) over ``mesh``'s axes: each training axis is the run of
    consecutive mesh axes with the same ranks."""
    names, sizes = device_mesh.mesh_dim_names, list(device_mesh.mesh.shape)
    if device_mesh.mesh.flatten().tolist() != list(range(mesh.size)):
        raise ValueError(
            f"{name}: the training mesh {dict(zip(names, sizes))} does not hold ranks 0 .. {mesh.size - 1}"
        )
    runs, i = {}, 0
    for axis, size in zip(names, sizes):
        run, n = [], 1
        while n < size and i < len(mesh.axis_names):
            run.append(mesh.axis_names[i])
            n *= mesh.axis_sizes[i]
            i += 1
        if n != size:
            raise ValueError(
                f"{name}: training mesh axis {axis!r} (size {size}) is not a run of the mesh {mesh.shape}'s axes in "
                f"row-major order; train and serve on meshes whose axes nest (e.g. FSDP over the whole world)"
            )
        runs[axis] = tuple(run)
    dims = [None if s is None else Shard(tuple(a for ax in s.axes for a in runs[ax])) for s in layout.dims]
    return Layout(tuple(dims))


def _assemble(family: Any, cfg: Any, meta: dict, layouts: dict, targets: dict, moved: dict) -> dict[str, Any]:
    """The params tree: each leaf its HF tensors' local pieces, joined along the fused dim in block order."""
    pieces: dict[str, list[torch.Tensor]] = {}
    for name, (path, _, _) in targets.items():
        pieces.setdefault(path, []).append(moved[name])

    def leaf(path: str, _: torch.Tensor) -> Any:
        if path not in pieces:  # a derived leaf (an expert map)
            return family.derived[path.rsplit(".", 1)[-1]](cfg)
        parts = pieces[path]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=fused_dim(layouts[path]))

    return map_with_path(leaf, meta)
