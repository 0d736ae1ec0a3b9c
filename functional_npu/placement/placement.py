"""A :class:`Placement`: one plan checked against one model config, one mesh's axes and one quantization, once, and
carried from load to compile.

It holds what every stage used to rebuild for itself: the resolved plan (layer-sharded series as leaf names), the
mesh's axes, the abstract params (meta tensors, in the params' form and in the per-layer form a checkpoint stores)
and every leaf's layout; and it answers what was spread over the loader, the compiler, the train step and the CLI:
a leaf's local shape, whether a params tree is this placement's shards (:meth:`Placement.check_params`), the axis
groups its collectives need, the leaf table, the plan file's JSON.

:func:`place` makes one, checked at every coordinate before anything is read, sharded or compiled, and caches it
(the same model, axes, plan and quantization give the same value); ``load_checkpoint`` returns params carrying it
(``params.placement``), and :func:`placement_of` is the one rule every consumer reads it by.

Example:
    >>> placed = place(cfg, Mesh.abstract({"dp": 2, "tp": 2}), Plan(layer_shard="o_proj"))   # doctest: +SKIP
    >>> placed.layouts["series.o_proj"]                                                       # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.params import Params
from ..core.shard import leaf_specs, local_shape
from ..core.tree import flatten_with_paths, register_static
from ..models import family_of
from ..parallel.layer_shard import series_specs, stack_series
from ..parallel.offload import host_specs, stack_host
from ..parallel.plan import LAYOUT_FIELDS, Plan
from .check import check_leaves, check_plan_fits, leaf_table, resolved
from .quant_config import QuantConfig
from .quant_layouts import quantize_plan

__all__ = ["Placement", "place", "placement_of", "read_placement", "builds", "check_plan", "plan_table"]

_WHERE = "\x00where\x00"  # the messages of a check made once for every caller name their caller when raised


@dataclass(frozen=True)
class Placement:
    """A plan checked against a model, a mesh's axes and a quantization (see the module docstring).

    Attributes:
        config: the model config.
        axes: the mesh's axes, ``((name, size), ...)`` in mesh order (no coordinate: every rank's placement).
        plan: the plan, its layer-sharded series resolved to the model's leaf names.
        quant: the checkpoint's quantization (``None``: floating-point weights).
        meta: the full params on the meta device, in the params' form (layer-sharded series stacked).
        layouts: each leaf's layout by path, in that form.
        stored: ``(meta, layouts)`` in the per-layer form a checkpoint stores (the same with no layer sharding).
    """

    config: Any
    axes: tuple[tuple[str, int], ...]
    plan: Plan
    quant: QuantConfig | None
    meta: dict = field(repr=False, compare=False)
    layouts: Mapping[str, Layout] = field(repr=False, compare=False)
    stored: tuple[dict, Mapping[str, Layout]] = field(repr=False, compare=False)

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def model(self) -> str:
        return self.config.architecture

    def describe(self) -> str:
        """One line: the model, the mesh's axes, the plan's changed fields and the quantization."""
        fields = ", ".join(f"{k}={v!r}" for k, v in self.plan.changed().items()) or "the default plan"
        quant = f", {self.quant.quant!r}" if self.quant else ""
        return f"{self.model} on {self.mesh_shape}: {fields}{quant}"

    def local_shape(self, path: str, mesh: Mesh) -> tuple[int, ...]:
        """The shape of leaf ``path`` at ``mesh``'s coordinate."""
        return local_shape(self.meta_leaves[path].shape, self.layouts[path], mesh, path=path)

    @functools.cached_property
    def meta_leaves(self) -> dict[str, Any]:
        return dict(flatten_with_paths(self.meta))

    def axis_groups(self) -> list[tuple[str, ...]]:
        """The multi-axis tuples some layout shards over (their collectives need a process group of their own)."""
        return sorted({d.axes for lay in self.layouts.values() for d in lay.dims if d is not None and len(d.axes) > 1})

    def held_bytes(self, mesh: Mesh) -> list[int]:
        """The bytes of params each rank of ``mesh`` holds, by rank."""
        return [
            sum(
                math.prod(local_shape(m.shape, self.layouts[p], mesh.at(r), path=p)) * m.element_size()
                for p, m in self.meta_leaves.items()
            )
            for r in range(mesh.size)
        ]

    def table(self) -> str:
        """A readable table: each leaf's full shape, layout and bytes on the rank holding the most; the plan."""
        return leaf_table(self.config, Mesh.abstract(self.mesh_shape), self.plan, self.meta, self.layouts)

    def fits(self, mesh: Mesh, where: str) -> None:
        """Raise a ValueError (one line) if ``mesh`` does not have this placement's axes."""
        if tuple(zip(mesh.axis_names, mesh.axis_sizes)) != self.axes:
            raise ValueError(
                f"{where}: the params were placed for mesh {self.mesh_shape} ({self.describe()}), but the mesh is "
                f"{mesh.shape}; load them for this mesh, or pass the mesh they were loaded for"
            )

    def check_params(self, params: Any, mesh: Mesh, where: str) -> None:
        """Raise naming the leaf if ``params`` are not ``mesh``'s coordinate's shards of this placement: a leaf missing,
        of another shape (sharded for another mesh or plan) or of another stored dtype, or for another model."""
        self.fits(mesh, where)
        if not isinstance(params, Params) or params.config != self.config:
            got = params.config if isinstance(params, Params) else None
            raise ValueError(
                f"{where}: the params' config ({getattr(got, 'architecture', type(got).__name__)}) is not the one "
                f"their placement was made for ({self.describe()}); load them again, or place them for their config"
            )
        got = {p.removesuffix(".streamed"): x for p, x in flatten_with_paths(params)}  # a compiled model's own params
        for path, x in self.meta_leaves.items():
            if path not in got:
                raise ValueError(f"{where}: params[{path!r}] is missing")
            want = local_shape(x.shape, self.layouts[path], mesh, path=path)
            if tuple(got[path].shape) != want:
                raise ValueError(
                    f"{where}: params[{path!r}] has shape {tuple(got[path].shape)} but mesh {mesh.shape} at "
                    f"{mesh.coordinate} expects {want}; were the params sharded for another mesh?"
                )
            if not x.dtype.is_floating_point and got[path].dtype != x.dtype:
                raise ValueError(
                    f"{where}: params[{path!r}] is {got[path].dtype} but {self.quant.quant!r} stores it as {x.dtype}"
                )

    def same_model(self, other: Placement, where: str) -> None:
        """Raise a ValueError naming every field in which ``other`` is not this placement's model, quantization and
        mesh (params of another model swapped in would run with this model's constants: rope, norms, sizes)."""
        mine, theirs = self.config, other.config
        diff = [
            f"{f.name}={getattr(theirs, f.name, None)!r} (compiled: {getattr(mine, f.name)!r})"
            for f in dataclasses.fields(mine)
            if getattr(theirs, f.name, None) != getattr(mine, f.name)
        ]
        if type(theirs) is not type(mine):
            diff = [f"a {type(theirs).__name__} (compiled: a {type(mine).__name__})"]
        if other.quant != self.quant:
            diff.append(f"quantization {other.quant!r} (compiled: {self.quant!r})")
        if other.axes != self.axes:
            diff.append(f"mesh {other.mesh_shape} (compiled: {self.mesh_shape})")
        if diff:
            raise ValueError(
                f"{where}: the params are not of the compiled model: {'; '.join(diff[:6])}"
                f"{' ...' if len(diff) > 6 else ''}; compile a model for them (its graphs bake in the config's "
                f"constants)"
            )

    def with_plan(self, plan: Plan, where: str) -> Placement:
        """This placement under ``plan``, a plan that differs from its own only in fields that decide no layout
        (``prefetch_step``, ``prefetch_budget``, ``dispatch_threshold``, ``absorb``, ``mla_cache``, ``model``): the
        one rule for a plan given beside placed params. Refused in one line naming the fields otherwise."""
        if not isinstance(plan, Plan):
            raise TypeError(f"{where}: plan must be a functional_npu.Plan, got {type(plan).__name__}")
        named = _resolved_or_given(self.config, plan, self.stored[0]["layers"])
        diff = [f for f, a, b in zip(LAYOUT_FIELDS, self.plan.layout_key(), named.layout_key()) if a != b]
        if diff:
            was = ", ".join(f"{f}={getattr(self.plan, f)!r}" for f in diff)
            now = ", ".join(f"{f}={getattr(named, f)!r}" for f in diff)
            free = ", ".join(f.name for f in dataclasses.fields(Plan) if f.name not in LAYOUT_FIELDS)
            raise ValueError(
                f"{where}: the params were loaded for another plan ({was}, given {now}); load them with this plan, "
                f"or change only the fields that decide no layout ({free})"
            )
        if named == self.plan:
            return self
        layers = self.stored[0]["layers"]
        check_plan_fits(self.config, Mesh.abstract(self.mesh_shape), named, where=where, layers=layers)
        return dataclasses.replace(self, plan=named)

    def to_json(self) -> str:
        """The plan file's JSON: the model, the mesh's axes and the plan (:func:`read_placement` reads it back)."""
        plan = dataclasses.replace(self.plan, model=self.model)
        return json.dumps({"model": self.model, "axes": self.mesh_shape, "plan": plan.to_dict()}, indent=1)


register_static(Placement)


def place(
    cfg: Any,
    mesh: Mesh | Mapping[str, int],
    plan: Plan | None = None,
    quant: QuantConfig | None = None,
    *,
    where: str = "model",
) -> Placement:
    """The :class:`Placement` of ``plan`` (default ``Plan()``) on ``cfg`` over ``mesh``'s axes (a mesh or a mapping of
    axis sizes) with ``quant``, checked at every coordinate (no I/O); cached.

    Raises:
        TypeError / ValueError / LayoutError starting with ``where``: the plan does not fit the model or the mesh, or
        the mesh cannot shard some leaf at some coordinate (naming the path, the dim, the sizes and the axis).
    """
    _check_inputs(cfg, mesh, quant, where)
    axes = tuple(zip(mesh.axis_names, mesh.axis_sizes)) if isinstance(mesh, Mesh) else tuple(dict(mesh).items())
    plan = Plan() if plan is None else plan
    if not isinstance(plan, Plan):
        raise TypeError(f"{where}: plan must be a functional_npu.Plan, got {type(plan).__name__}")
    try:
        return _placed(cfg, axes, plan, quant)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace(_WHERE, where)) from None


def _check_inputs(cfg: Any, mesh: Any, quant: Any, where: str) -> None:
    """One line (a TypeError) for a config, mesh or quantization of the wrong type, before any is hashed or read."""
    if isinstance(cfg, str) or cfg is None:
        raise TypeError(f"{where}: cfg must be a model config (functional_npu.read_config(path)), got {cfg!r}")
    try:
        family_of(cfg)
    except TypeError as e:
        raise TypeError(f"{where}: cfg: {e} (functional_npu.read_config(path) reads one)") from None
    if not isinstance(mesh, (Mesh, Mapping)):
        raise TypeError(
            f"{where}: mesh must be a functional_npu.Mesh or a dict of axis sizes such as {{'dp': 2, 'tp': 1}}, got "
            f"{type(mesh).__name__}"
        )
    if quant is not None and not isinstance(quant, QuantConfig):
        raise TypeError(
            f"{where}: quant must be a QuantConfig (e.g. QuantConfig.of(Quant(8)), or read_quant_config of a "
            f"checkpoint's config.json) or None, got {quant!r}"
        )


@functools.lru_cache(maxsize=64)
def _placed(cfg: Any, axes: tuple[tuple[str, int], ...], plan: Plan, quant: QuantConfig | None) -> Placement:
    mesh = Mesh.abstract(dict(axes))
    family = family_of(cfg)
    meta = family.abstract_params(cfg, plan)  # the one build: its per-layer leaves say which series exist
    check_plan_fits(cfg, mesh, plan, where=_WHERE, layers=meta["layers"])
    plan = resolved(cfg, plan, meta["layers"])
    specs = family.param_specs(cfg, plan)
    if quant is not None:
        meta, specs = quantize_plan(family, cfg, quant, meta, specs, where=_WHERE)
    stored = (meta, leaf_specs(specs, meta))
    if plan.layer_shard is not None:
        meta, specs = stack_series(meta, plan.layer_shard), series_specs(specs, plan.layer_shard, cfg.num_layers)
    if plan.offload:
        meta, specs = stack_host(meta, plan.offload), host_specs(specs, plan.offload, cfg.num_layers)
    if plan.layer_shard is not None or plan.offload:
        layouts = leaf_specs(specs, meta)
    else:
        layouts = stored[1]
    check_leaves(cfg, mesh, meta, layouts, where=_WHERE)
    return Placement(cfg, axes, plan, quant, meta, layouts, stored)


def builds() -> int:
    """How many placements this process has built (a cached one builds none), refused ones included."""
    return _placed.cache_info().misses


def check_plan(
    cfg: Any,
    mesh: Mesh,
    plan: Plan | None = None,
    *,
    where: str = "model",
    quant: QuantConfig | None = None,
) -> tuple[dict[str, Any], dict[str, Layout]]:
    """Raise a ValueError if ``plan`` does not fit ``cfg`` or ``mesh`` cannot shard it at any of its
    coordinates (no I/O): :func:`~functional_npu.placement.place`, cached.

    Args:
        cfg: a model config (from ``read_config``).
        mesh: the mesh; its coordinate is ignored, every coordinate is checked.
        plan: the parallel plan (default: ``Plan()``, tensor parallelism over ``"tp"``).
        where: what the messages start with (the model directory, ``compile_model``).
        quant: a quantized checkpoint's scheme: the linear leaves it covers are the dicts of their
            stored tensors (:func:`functional_npu.placement.quant_layouts.quantize_plan`).

    Returns:
        The full params on the meta device and each leaf's layout; with ``plan.layer_shard``, in the layer-sharded
        structure (series stacked under ``params["series"]``).
    """
    placed = place(cfg, mesh, plan, quant, where=where)
    return placed.meta, dict(placed.layouts)


def plan_table(cfg: Any, mesh: Mesh, plan: Plan | None = None, *, quant: QuantConfig | None = None) -> str:
    """A readable table of ``plan`` on ``cfg`` over ``mesh``: each leaf (a layer leaf once for the layers whose
    rows agree: ``layers.*`` for every layer, ``layers.1,3`` for some), its full shape, its layout and its bytes on
    the rank that holds the most; then the plan's fields and the total bytes per rank. Checked first
    (:func:`check_plan`).

    Example:
        >>> print(plan_table(read_config(path), Mesh.abstract({"tp": 2}), Plan()))     # doctest: +SKIP
    """
    return place(cfg, mesh, plan, quant).table()


def placement_of(params: Any, mesh: Mesh, plan: Plan | None = None, *, where: str) -> Placement:
    """The placement ``params`` are sharded by, for a consumer on ``mesh``: the one they carry
    (``params.placement``, as ``load_checkpoint`` leaves it) under ``plan`` if given (:meth:`Placement.with_plan`);
    for params that carry none (``shard`` of a family's full params), ``plan`` (default ``Plan()``) placed on their
    config. Either way it is then checked against ``mesh`` and the params' shapes.

    Raises:
        TypeError for params with no model config; ValueError naming the leaf, the field or the mesh otherwise.
    """
    if not isinstance(params, Params):
        raise TypeError(
            f"{where}: params must be a functional_npu.Params (the tree with its config and placement), got "
            f"{type(params).__name__}; load them with load_checkpoint, or Params(tree, config) for a tree of your own"
        )
    cfg = params.config
    try:
        family_of(cfg)
    except (TypeError, ValueError):
        raise TypeError(
            f"{where}: params carry no model config (params.config is {cfg!r}); load them with load_checkpoint, or "
            f"give Params(tree, config) one"
        ) from None
    own = params.placement
    if own is None:
        placed = place(cfg, mesh, plan, where=where)
    elif not isinstance(own, Placement):
        raise TypeError(f"{where}: params.placement must be a Placement, got {type(own).__name__}")
    else:
        placed = own if plan is None else own.with_plan(plan, where)
    placed.check_params(params, mesh, where)
    return placed


def read_placement(path: str | Path, cfg: Any, quant: QuantConfig | None = None, *, where: str = "") -> Placement:
    """The placement a plan file (:meth:`Placement.to_json`) describes, checked on ``cfg``: refused in one line if the
    file is not one or is for another model."""
    where = where or str(path)
    data = _read_json(path, where)
    if not isinstance(data, dict) or not {"model", "axes", "plan"} <= set(data):
        raise ValueError(
            f"{where}: a plan file is a JSON object with model, axes and plan (python -m functional_npu plan --out "
            f"FILE writes one)"
        )
    if not isinstance(data["model"], str) or not data["model"].strip():
        raise ValueError(
            f"{where}: model must name the architecture the plan was made for (e.g. {cfg.architecture!r}), got "
            f"{data['model']!r}; python -m functional_npu plan --out FILE writes it"
        )
    if data["model"] != cfg.architecture:
        raise ValueError(
            f"{where}: the plan was made for {data['model']}, but this model is a {cfg.architecture}; "
            f"make a plan for this model (python -m functional_npu plan --model ...)"
        )
    axes = data["axes"]
    if not (isinstance(axes, dict) and axes and all(_axis_size(k, v) for k, v in axes.items())):
        raise ValueError(f"{where}: axes must map mesh axis names (dp, tp, ...) to positive ints, got {axes!r}")
    plan = Plan.from_dict(data["plan"], where=where)
    _check_axes_used(axes, plan, where)
    return place(cfg, axes, plan, quant, where=where)


def _check_axes_used(axes: dict, plan: Plan, where: str) -> None:
    """Refuse a plan file's axis of more than one rank that nothing in it names: not the plan's tensor-parallel axis,
    not ``dp``, and no series, module or expert group's axis (it would start ranks the plan never meant)."""
    named = {plan.tp, "dp", *plan.expert_axes, *(a for _, group in plan.module_tp.items() for a in group)}
    if plan.layer_shard is not None:
        named.add(plan.layer_shard.axis)
    for axis, size in axes.items():
        if size > 1 and axis not in named:
            raise ValueError(
                f"{where}: mesh axis {axis!r} of size {size} is used by nothing in the plan (tensor parallel over "
                f"{plan.tp!r}, data parallel over 'dp'), yet it would start {size}x the ranks; drop it, or name it "
                f"'dp' to run {size} data-parallel replicas"
            )


def _read_json(path: Any, where: str) -> Any:
    """The JSON value of the file at ``path``; one line for a path that is not a readable regular file (a FIFO with no
    writer would block forever) or a file that is not JSON."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"plan file: expected the path of a plan file, got {path!r}")
    file = Path(path)
    try:
        if not file.is_file():
            raise ValueError(
                f"{where}: {'no such file' if not file.exists() else 'not a regular file'}; give the path of a plan "
                f"file (python -m functional_npu plan --out FILE writes one)"
            )
        text = file.read_bytes().decode("utf-8")
    except OSError as e:
        raise ValueError(f"{where}: cannot read the plan file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where}: not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}): a plan file is JSON; "
            f"write one with python -m functional_npu plan --out FILE"
        ) from None
    try:
        return json.loads(text, object_pairs_hook=functools.partial(_once, where=where))
    except _Twice as e:
        raise ValueError(str(e)) from None
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e}); write one with python -m functional_npu plan --out FILE") from None
    except RecursionError:  # a plan file is a few levels deep: thousands of nested brackets are not one
        raise ValueError(
            f"{where}: JSON nested too deeply to read; a plan file is an object of model, axes and plan, a few "
            f"levels deep: write one with python -m functional_npu plan --out FILE"
        ) from None


class _Twice(Exception):
    """A JSON object in a plan file that names one key twice."""


def _once(pairs: list[tuple[str, Any]], where: str) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key given twice (JSON would keep the last silently: a mesh axis
    written twice would be a mesh of other ranks than the file shows)."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise _Twice(
            f"{where}: the plan file names {', '.join(map(repr, twice))} twice in one object ({dict(pairs)!r} keeps "
            f"only the last); write each key once"
        )
    return dict(pairs)


def _axis_size(name: Any, size: Any) -> bool:
    return isinstance(name, str) and name.isidentifier() and type(size) is int and size >= 1


def _resolved_or_given(cfg: Any, plan: Plan, layers: Any) -> Plan:
    """``plan`` with its series resolved for ``cfg`` where it can be (``down_proj`` is ``down``), so two spellings of
    one plan compare equal; as given where it cannot (the checks that follow name the problem)."""
    try:
        return resolved(cfg, plan, layers)
    except (ValueError, TypeError, KeyError):
        return plan
