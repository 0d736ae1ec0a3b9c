"""Module-specific tensor parallelism over data-parallel ranks (vllm-ascend's fine-grained TP groups).

With data-parallel attention every dp rank attends its own requests. A chosen module can still be
tensor-parallel over a *chunk* of ``n`` consecutive dp ranks at one tp index (the seed's
``oproj`` / ``lmhead`` / ``embedding`` / ``mlp`` tensor-parallel groups): that chunk is the inner
part of a split of ``dp`` (``mesh.split("dp", ("dp", "dp2"), (dp // 2, 2))``), so a module's group
is a tuple of mesh axes, and the plan is data: :class:`ModuleTP` says which axes each module is
tensor-parallel over, on top of the tensor-parallel axis.

How each module uses its group (the blocks in :mod:`functional_npu.models`; ``n`` ranks, each with
its own ``B`` rows, padded to one static count per step, the lockstep the runner already keeps):

- ``o_proj``: the attention output's column blocks are exchanged (all_to_all), each rank multiplies
  the group's ``n B`` rows by its ``1 / n`` of o_proj's input dim, and the partial sums are
  reduce-scattered back to their rows' rank;
- ``lm_head``: hidden states all-gathered, each rank computes its vocab slice for ``n B`` rows, and
  the slices are routed back (all_to_all), or only each slice's (max, argmax) for greedy decode;
- ``embed``: ids all-gathered, masked lookup of this rank's rows, reduce-scatter;
- ``mlp``: hidden states all-gathered, column-parallel gate_up, row-parallel down, reduce-scatter.

Each module's weight dim is cut over ``axes + (tp,)`` (mesh order: the dp split precedes tp), so a
module-TP'd weight's layout stays one :class:`~functional_npu.core.layout.Shard`, and it can still
be layer-sharded over an axis it is replicated on (the seed's shard-weight group, e.g. the outer
``dp``).

:func:`split_dp` builds such a mesh from module sizes: ``dp`` becomes a chain of axes, the outer one
keeping the name ``"dp"`` and axis ``dpN`` completing chunks of ``N`` consecutive dp ranks; a module
of size ``N`` is tensor-parallel over ``dpN`` and the axes inside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from ..core.mesh import Mesh

__all__ = ["MODULES", "ModuleTP", "split_dp", "check_module_tp", "dp_axes"]

MODULES = ("o_proj", "lm_head", "embed", "mlp")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleTP:
    """Which data-parallel mesh axes each module is tensor-parallel over (``()``: none, the default).

    Attributes:
        o_proj: attention's output projection (row-parallel over the group's rows).
        lm_head: the output head (vocab-parallel over the group's rows).
        embed: the input embedding (vocab-parallel over the group's ids).
        mlp: every dense gated MLP (column- then row-parallel over the group's rows).
    """

    o_proj: tuple[str, ...] = ()
    lm_head: tuple[str, ...] = ()
    embed: tuple[str, ...] = ()
    mlp: tuple[str, ...] = ()

    def __post_init__(self) -> None:  # accept "dp2" and lists; store hashable tuples
        for f in fields(self):
            value = getattr(self, f.name)
            axes = (value,) if isinstance(value, str) else value
            if not isinstance(axes, (tuple, list)) or not all(isinstance(a, str) and a.isidentifier() for a in axes):
                raise ValueError(
                    f"ModuleTP.{f.name} must be mesh axis names such as ('dp2',) (module TP over dp ranks), got "
                    f"{value!r}; to give a size, split dp with split_dp(axes, {{{f.name!r}: {value!r}}})"
                )
            object.__setattr__(self, f.name, tuple(axes))

    def items(self) -> list[tuple[str, tuple[str, ...]]]:
        """(module, axes) for every module that has a group."""
        return [(m, getattr(self, m)) for m in MODULES if getattr(self, m)]

    def __bool__(self) -> bool:
        return bool(self.items())


def split_dp(axes: Mapping[str, int], sizes: Mapping[str, int], *, dp: str = "dp") -> tuple[dict[str, int], ModuleTP]:
    """Mesh axes with ``dp`` split for the module sizes, and the plan using them.

    Args:
        axes: the mesh's axes, e.g. ``{"dp": 4, "tp": 2}``.
        sizes: module -> its TP size over dp ranks (1: none), e.g. ``{"o_proj": 2, "lm_head": 4}``.

    Returns:
        e.g. ``({"dp": 1, "dp4": 2, "dp2": 2, "tp": 2}, ModuleTP(o_proj=("dp2",), lm_head=("dp4", "dp2")))``.

    Raises:
        ValueError naming the module, its size and the dp size: a size that does not divide dp,
        exceeds it, or does not divide / is not divided by another module's size (the chunks must
        nest to be axes of one mesh).
    """
    unknown = sorted(set(sizes) - set(MODULES))
    if unknown:
        raise ValueError(f"module TP: unknown modules {unknown}; choose from {MODULES}")
    if dp not in axes:
        raise ValueError(f"module TP needs a {dp!r} axis to split; the mesh axes are {dict(axes)}")
    n_dp = axes[dp]
    for m, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"module TP: {m} size must be a positive int, got {n!r}")
        if n > n_dp:
            raise ValueError(
                f"module TP: {m} size {n} exceeds the {dp!r} size {n_dp}; its group is a chunk of {dp} ranks"
            )
        if n_dp % n:
            raise ValueError(
                f"module TP: {m} size {n} must divide the {dp!r} size {n_dp} (it is a chunk of {dp} ranks); "
                f"use one of {[d for d in range(1, n_dp + 1) if n_dp % d == 0]}"
            )
    chain = sorted({n for n in sizes.values() if n > 1})
    for small, big in zip(chain, chain[1:]):
        if big % small:
            mods = [m for m, n in sizes.items() if n in (small, big)]
            raise ValueError(
                f"module TP: sizes {small} and {big} ({', '.join(mods)}) do not nest (one must divide the other), "
                f"so their groups are not axes of one mesh; use sizes that divide one another"
            )
    inner = [f"{dp}{n}" for n in reversed(chain)]  # outermost chunk first
    clash = sorted(set(inner) & set(axes))
    if clash:
        raise ValueError(f"module TP: the mesh already has axes {clash}; rename them")
    out: dict[str, int] = {}
    for a, s in axes.items():
        if a != dp:
            out[a] = s
            continue
        out[dp] = n_dp // (chain[-1] if chain else 1)
        for big, small in zip(reversed(chain), [*reversed(chain[:-1]), 1]):
            out[f"{dp}{big}"] = big // small  # with the axes inside it: chunks of `big` dp ranks
    groups = {n: tuple(inner[inner.index(f"{dp}{n}") :]) for n in chain}
    return out, ModuleTP(**{m: groups[n] for m, n in sizes.items() if n > 1})


def dp_axes(mesh: Mesh, tp_axis: str = "tp") -> tuple[str, ...]:
    """The data-parallel axes: every mesh axis but ``tp_axis`` (``("dp",)`` or a split of it)."""
    if tp_axis not in mesh.axis_names:
        raise ValueError(
            f"dp_axes: tp_axis {tp_axis!r} is not an axis of the mesh {mesh.shape}; name its tensor-parallel axis "
            f"(a mesh without one has a 'tp' axis of size 1)"
        )
    return tuple(a for a in mesh.axis_names if a != tp_axis)


def check_module_tp(
    plan: ModuleTP, mesh: Mesh, *, tp_axis: str = "tp", taken: Sequence[str] = (), where: str = "model"
) -> None:
    """Raise a ValueError if ``plan`` cannot run on ``mesh``: a module's axes unknown, repeated, out of mesh
    order, including or after ``tp_axis``, or shared with ``taken`` (the experts' axes: EP over the
    same ranks as a module TP group is not supported)."""
    names = mesh.axis_names
    for module, axes in plan.items():
        what = f"{where}: {module} TP over mesh axes {axes}"
        missing = [a for a in axes if a not in names]
        if missing:
            raise ValueError(f"{what}: {missing[0]!r} is not an axis of the mesh {mesh.shape}; split dp first")
        if tp_axis in axes:
            raise ValueError(f"{what}: the tensor-parallel axis {tp_axis!r} is already every module's; drop it")
        if len(set(axes)) != len(axes) or tuple(a for a in names if a in axes) != axes:
            raise ValueError(f"{what}: axes must be distinct and in mesh order {names}")
        if tp_axis in names and max(names.index(a) for a in axes) > names.index(tp_axis):
            raise ValueError(f"{what}: the group's axes must precede {tp_axis!r} in the mesh {names}")
        shared = sorted(set(axes) & set(taken))
        if shared:
            raise ValueError(
                f"{what}: axes {shared} also shard the experts {tuple(taken)}; module TP and expert "
                f"parallelism over the same ranks is not supported: drop one of them"
            )
