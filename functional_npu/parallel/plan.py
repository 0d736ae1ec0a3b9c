"""The parallel plan: one immutable value holding every technique's choice over the mesh.

A model config says what a checkpoint holds; a :class:`Plan` says where each piece of it lives and
how the forward moves it, as JAX keeps ``NamedSharding(mesh, PartitionSpec)`` apart from the function:

- ``tp``: the tensor-parallel mesh axis (attention heads, MLP columns, the vocab);
- ``expert_axes``, ``num_slots``, ``max_copies``, ``dispatch_threshold``: expert parallelism
  (:mod:`functional_npu.models.experts`);
- ``module_tp``: modules tensor-parallel over data-parallel axes too (:mod:`.module_tp`);
- ``layer_shard`` and ``prefetch_step`` / ``prefetch_budget``: layer-sharded weight series and how far
  ahead they are fetched (:mod:`.layer_shard`, :mod:`.prefetch`, ``"auto"``: :mod:`.prefetch_cost`);
- ``offload``: weight series kept whole in host memory, fetched into the same ring (:mod:`.offload`);
- ``absorb``, ``mla_cache``: multi-head latent attention's decode path and cache (:mod:`functional_npu.models.mla`);
- ``invariant``: every reduction of the forward in one fixed order, so that a rollout's log-probabilities equal the
  training forward's bit for bit: ``"batch"`` on the fast kernels (:mod:`functional_npu.models.batch_invariant`),
  ``"portable"`` across devices (:mod:`functional_npu.models.invariant`);
- ``model``: the architecture the plan was made for (``None``: any), so a plan kept for one model is
  refused by name on another.

The plan is built once (in Python, from the CLI's flags, or from a dict with :meth:`Plan.from_dict`; a plan file
holds it beside the mesh's axes, :func:`functional_npu.placement.read_placement`), checked once against the model
config and the mesh (:func:`functional_npu.placement.place`), and passed to ``load_checkpoint``, ``compile_model``
and ``from_dtensor_state``; loaded params carry the checked placement as ``params.placement``. A changed plan is
``dataclasses.replace(plan, field=value)`` (the one setter: values are normalized and checked on
construction).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..core.numbers import is_int
from ..core.tree import register_static
from .layer_shard import LayerShard, layer_shard
from .module_tp import MODULES, ModuleTP
from .offload import offload_names

__all__ = ["Plan", "LAYOUT_FIELDS", "EXPERT_FIELDS", "MLA_FIELDS", "MLA_CACHES", "INVARIANT_MODES"]

MLA_CACHES = ("latent", "heads")
INVARIANT_MODES = ("batch", "portable")  # Plan.invariant's modes (True: "portable")
# fields that decide the params' layouts (params loaded for one plan run only under a plan agreeing on these)
LAYOUT_FIELDS = ("tp", "expert_axes", "num_slots", "max_copies", "module_tp", "layer_shard", "offload")
# fields only a family with experts / with latent attention reads (a family declares them, models.family)
EXPERT_FIELDS = ("expert_axes", "num_slots", "max_copies", "dispatch_threshold")
MLA_FIELDS = ("absorb", "mla_cache")


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Every parallel choice for one model over one mesh's axis names (see the module docstring).

    Attributes:
        tp: the tensor-parallel mesh axis (size 1 for none).
        expert_axes: mesh axes the expert slots are sharded over (``()``: every rank holds every expert).
        num_slots: physical expert slots (experts plus redundant copies; ``None``: one per expert).
        max_copies: the most slots one expert has (the width of each MoE layer's ``expert_map``).
        dispatch_threshold: tokens per rank at or below which experts gather tokens instead of exchanging them.
        module_tp: modules tensor-parallel over data-parallel axes too (a :class:`ModuleTP` or a dict).
        layer_shard: layer-sharded series (a :class:`LayerShard`, or ``"o_proj,down"`` over ``"dp"``).
        prefetch_step: fetch layer ``l + k``'s series while layer ``l`` computes; ``"auto"``: the cost model's k.
        prefetch_budget: for ``"auto"``: the most bytes the prefetch ring (``k + 1`` slots of one layer) may take.
        offload: series kept whole in host memory and copied into the prefetch ring ``prefetch_step`` layers ahead
            (names as for ``layer_shard``: ``"o_proj,down"``, ``"layer"``; :mod:`.offload`).
        absorb: latent attention's decode steps attend in the latent space.
        mla_cache: latent attention's cache, ``"latent"`` or ``"heads"`` (every head's keys and values).
        invariant: the forward's reductions in one fixed order whatever the batch, position, cache length or padding:
            the same logits for a sequence in a rollout and in training. ``"batch"``: on the fast kernels, each
            reduction's order pinned (:mod:`functional_npu.models.batch_invariant`), the same bits on one device kind
            and kernel build; ``"portable"`` (or ``True``): trees of adds and polynomials
            (:mod:`functional_npu.models.invariant`), the same bits on every device that rounds IEEE adds, at many
            times the cost; ``False``: off.
        model: the architecture this plan was made for (``None``: any).

    Example:
        >>> plan = Plan(tp="tp", layer_shard="o_proj,down", prefetch_step=1)
        >>> plan.layer_shard
        LayerShard('dp', ['o_proj', 'down'])
    """

    tp: str = "tp"
    expert_axes: tuple[str, ...] = ()
    num_slots: int | None = None
    max_copies: int = 1
    dispatch_threshold: int = 8
    module_tp: ModuleTP = ModuleTP()
    layer_shard: LayerShard | None = None
    prefetch_step: int | str = 0
    prefetch_budget: float | None = None
    offload: tuple[str, ...] = ()
    absorb: bool = True
    mla_cache: str = "latent"
    invariant: bool | str = False
    model: str | None = None

    def __post_init__(self) -> None:
        _set = object.__setattr__
        if not _axis_name(self.tp):
            raise ValueError(f"Plan.tp must be a mesh axis name such as 'tp', got {self.tp!r}")
        axes = (self.expert_axes,) if isinstance(self.expert_axes, str) else self.expert_axes
        if not isinstance(axes, (tuple, list)) or not all(_axis_name(a) for a in axes):
            raise ValueError(f"Plan.expert_axes must be mesh axis names such as ('dp', 'tp'), got {self.expert_axes!r}")
        twice = sorted({a for a in axes if list(axes).count(a) > 1})
        if twice:  # the slots would be cut over one axis twice: two coordinates on one rank
            raise ValueError(
                f"Plan.expert_axes names {', '.join(map(repr, twice))} more than once ({tuple(axes)}); name each mesh "
                f"axis once, in mesh order, e.g. ('dp', 'tp')"
            )
        _set(self, "expert_axes", tuple(axes))
        if isinstance(self.module_tp, Mapping):
            unknown = sorted(set(self.module_tp) - set(MODULES))
            if unknown:
                raise ValueError(f"Plan.module_tp: unknown modules {unknown}; choose from {MODULES}")
            _set(self, "module_tp", ModuleTP(**self.module_tp))
        elif not isinstance(self.module_tp, ModuleTP):
            raise ValueError(f"Plan.module_tp must be a ModuleTP or a dict of module -> axes, got {self.module_tp!r}")
        _set(self, "layer_shard", _layer_shard(self.layer_shard))
        _set(self, "offload", offload_names(self.offload))
        _check_ints(self)
        if self.prefetch_step != "auto" and not is_int(self.prefetch_step, 0):
            raise ValueError(f"Plan.prefetch_step must be an int >= 0 or 'auto', got {self.prefetch_step!r}")
        if self.prefetch_step != "auto" and self.prefetch_step > MAX_STEP:
            raise ValueError(
                f"Plan.prefetch_step {self.prefetch_step} is past any model's layers: a ring of k + 1 slots holds "
                f"at most all of them; give an int in [0, {MAX_STEP}] (place() bounds it by num_layers - 1) or 'auto'"
            )
        budget = self.prefetch_budget
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget < float("inf")
        ):
            raise ValueError(
                f"Plan.prefetch_budget must be a positive, finite number of bytes (or None), got {budget!r}"
            )
        if not isinstance(self.absorb, bool):
            raise ValueError(f"Plan.absorb must be True or False, got {self.absorb!r}")
        if self.invariant is True:
            _set(self, "invariant", "portable")
        elif self.invariant is not False and self.invariant not in INVARIANT_MODES:
            raise ValueError(
                f"Plan.invariant must be False, 'batch' (batch-invariant on the fast kernels: the same bits on one "
                f"device kind) or 'portable' (the same bits on any IEEE device, many times slower), got "
                f"{self.invariant!r}"
            )
        if self.mla_cache not in MLA_CACHES:
            raise ValueError(f"Plan.mla_cache must be one of {MLA_CACHES}, got {self.mla_cache!r}")
        if self.model is not None and not (isinstance(self.model, str) and self.model.strip()):
            raise ValueError(
                f"Plan.model must be an architecture name such as 'Qwen3ForCausalLM' (or None: any), got {self.model!r}"
            )

    def slots(self, num_experts: int) -> int:
        """Physical expert slots for a model of ``num_experts`` experts."""
        return self.num_slots or num_experts

    def changed(self) -> dict[str, Any]:
        """The fields that differ from the default plan's."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def layout_key(self) -> tuple:
        """The fields that decide the params' layouts (params loaded under one plan run under another only
        when these agree)."""
        return tuple(getattr(self, f) for f in LAYOUT_FIELDS)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (read back by :meth:`from_dict`)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ModuleTP):
                value = {m: list(a) for m, a in value.items()}
            elif isinstance(value, LayerShard):
                value = {"axis": value.axis, "leaves": list(value.leaves)}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @staticmethod
    def from_dict(data: Mapping[str, Any], *, where: str = "plan") -> Plan:
        """A plan from :meth:`to_dict`'s form (missing fields take their defaults); one line for a bad field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: a plan is a JSON object of fields, got {type(data).__name__}")
        names = [f.name for f in fields(Plan)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"{where}: unknown plan fields {unknown}; the fields are {names}")
        try:
            return Plan(**data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    def __str__(self) -> str:
        rows = [(f.name, _show(getattr(self, f.name))) for f in fields(self)]
        width = max(len(n) for n, _ in rows)
        return "Plan\n" + "\n".join(f"  {n:<{width}}  {v}" for n, v in rows)


register_static(Plan)


def _axis_name(a: Any) -> bool:
    return isinstance(a, str) and a.isidentifier()


# the largest counts a plan may name: past them an expert map's width or a slot count overflows the loader's int64
# tensors (max_copies=10**30 once reached torch as an overflow error)
MAX_SLOTS = 1 << 31
MAX_COPIES = 1 << 20
MAX_THRESHOLD = 1 << 40
MAX_STEP = 1 << 16  # a prefetch step past any model's layers (a ring of k + 1 slots holds at most all of them)


def _check_ints(plan: Plan) -> None:
    if plan.num_slots is not None and not is_int(plan.num_slots, 1, MAX_SLOTS):
        raise ValueError(
            f"Plan.num_slots must be an int in [1, {MAX_SLOTS}] (or None: one per expert), got {plan.num_slots!r}"
        )
    if not is_int(plan.max_copies, 1, MAX_COPIES):
        raise ValueError(f"Plan.max_copies must be an int in [1, {MAX_COPIES}], got {plan.max_copies!r}")
    if not is_int(plan.dispatch_threshold, 0, MAX_THRESHOLD):
        raise ValueError(
            f"Plan.dispatch_threshold must be an int in [0, {MAX_THRESHOLD}], got {plan.dispatch_threshold!r}"
        )


def _layer_shard(value: Any) -> LayerShard | None:
    """A :class:`LayerShard` from itself, series names (over ``"dp"``) or ``{"axis", "leaves" | "series"}``."""
    if value is None or isinstance(value, LayerShard):
        return value
    if isinstance(value, (str, list, tuple)):
        return layer_shard(value)
    if isinstance(value, Mapping) and set(value) in ({"axis", "leaves"}, {"axis", "series"}, {"series"}):
        if "series" in value:
            return layer_shard(value["series"], value.get("axis", "dp"))
        if not isinstance(value["leaves"], (list, tuple)):
            raise ValueError(f"Plan.layer_shard: leaves must be a list of series names, got {value['leaves']!r}")
        return layer_shard(value["leaves"], value["axis"])
    raise ValueError(
        f"Plan.layer_shard must be a LayerShard, series names like 'o_proj,down', or "
        f'{{"axis": "dp", "series": "o_proj,down"}}, got {value!r}'
    )


def _show(value: Any) -> str:
    if isinstance(value, ModuleTP):
        return ", ".join(f"{m} over {a}" for m, a in value.items()) or "none"
    if isinstance(value, LayerShard):
        return f"{', '.join(value.leaves)} over {value.axis!r}"
    if isinstance(value, tuple) and not value:
        return "none"
    return repr(value)
