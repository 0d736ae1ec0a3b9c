"""Megatron-style training layouts, as layout data over this library's param paths (for families that declare
their Megatron names, :attr:`functional_npu.models.Family.megatron`: the Llama family's today).

The source side of train-to-inference weight sync (``reshard``):

* tensor parallel: ``linear_fc1`` holds ``[gate_r | up_r]`` on each rank (our fused ``gate_up``);
  ``linear_qkv`` holds whole KV groups ``[q heads of group g, k_g, v_g]`` (our ``qkv`` with
  ``groups=num_kv_heads``); row-parallel ``linear_proj`` / ``linear_fc2``; vocab-parallel
  embedding and output layer.
* pipeline parallel: every leaf is stacked on a leading dim (:func:`stack_layers`); pipeline rank
  ``p`` of ``pp`` holds, for each virtual chunk ``v`` of ``vpp``, the layers
  ``v * L/vpp + p * L/(vpp*pp) + [0, L/(vpp*pp))`` (Megatron's interleaved schedule), i.e. the
  layer dim is ``vpp`` blocks each cut over ``pp``; within a chunk layers are numbered from 0.
  The embedding lives on the first stage, the final norm and output layer on the last.
* expert parallel: a stacked expert dim cut over an ``ep`` axis (``sharded(0, "ep")``).

The family's Megatron names (``family.megatron.names``) are the one table from Megatron parameter names to our
paths; :func:`from_megatron` / :func:`to_megatron` only rename and stack (no data moves).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..core.agree import agreed
from ..core.layout import Block, Cyclic, DimSpec, Layout, Shard
from ..core.mesh import Mesh
from ..core.numbers import require_int
from ..core.params import Params
from ..core.shard import local_shape
from ..models import FAMILIES, Family, family_of
from ..parallel.plan import Plan

__all__ = [
    "megatron_specs",
    "megatron_pipeline_specs",
    "pipeline_dim",
    "stack_layers",
    "unstack_layers",
    "stacked_specs",
    "from_megatron",
    "to_megatron",
]


def _megatron(cfg: Any, where: str) -> Family:
    family = family_of(cfg)
    if family.megatron is None:
        known = [a for f in FAMILIES if f.megatron is not None for a in f.architectures]
        raise ValueError(f"{where}: Megatron's layout of a {cfg.architecture} is not known; known: {', '.join(known)}")
    return family


def megatron_specs(cfg: Any, *, tp_axis: str = "tp") -> dict[str, Any]:
    """Megatron's tensor-parallel layout of the (unstacked) params: the family's ``param_specs`` with the leaves
    Megatron cuts its own way (the Llama family's QKV grouped by KV head).

    Args:
        cfg: the model config.
        tp_axis: the mesh axis Megatron's tensor-parallel group runs over.

    Returns:
        A spec tree over the family's ``abstract_params(cfg)`` (the list-of-layers form).

    Example (tp=2 training to tp=2 inference: each rank only reorders its own QKV rows):
        >>> inference = reshard(train, megatron_specs(cfg), llama.param_specs(cfg), mesh)    # doctest: +SKIP
    """
    family, plan = _megatron(cfg, "megatron_specs"), Plan(tp=tp_axis)
    specs = _rename_axis(family.param_specs(cfg), tp_axis)
    own = family.megatron.layouts(cfg, plan)
    for layer in specs["layers"]:
        layer |= {leaf: lay for leaf, lay in own.items() if leaf in layer}
    return specs


def _rename_axis(specs: dict[str, Any], axis: str) -> dict[str, Any]:
    def one(lay: Layout) -> Layout:
        dims = tuple(
            d if d is None else Shard((axis,), d.blocks, d.pack, d.groups, d.group_size) if isinstance(d, Shard) else d
            for d in lay.dims
        )
        return Layout(dims)

    out = {k: one(v) for k, v in specs.items() if k != "layers"}
    return out | {"layers": [{k: one(v) for k, v in layer.items()} for layer in specs["layers"]]}


def pipeline_dim(num_layers: int, pp_axis: str = "pp", vpp: int = 1) -> DimSpec:
    """The stacked layer dim of a Megatron pipeline: ``vpp`` chunks of ``L/vpp`` layers, each chunk cut over ``pp``."""
    _check_chunks(num_layers, vpp, "pipeline_dim", f"{num_layers} layers")
    if vpp == 1:
        return Shard((pp_axis,))
    return Shard((pp_axis,), tuple(Block(f"chunk{v}", num_layers // vpp) for v in range(vpp)))


def _check_chunks(num_layers: int, vpp: Any, where: str, what: str, fix: str = "") -> None:
    """``vpp`` an int >= 1 that divides ``num_layers`` (``what``: those layers, in words)."""
    require_int(vpp, f"{where}: vpp", 1)
    if num_layers % vpp:
        raise ValueError(
            f"{where}: {what} cannot be cut into vpp={vpp} virtual chunks; use a vpp that divides {num_layers}{fix}"
        )


# ---- stacked form -------------------------------------------------------------------------------
def stack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
    """Every leaf with a leading stacking dim: ``layers`` as ``{name: [L, ...]}``, others as ``[1, ...]``. Pure.

    Example:
        >>> stack_layers(params)["layers"]["qkv"].shape     # doctest: +SKIP
        torch.Size([num_layers, (H + 2K) * hd, D])
    """
    layers = params.get("layers") if isinstance(params, (Mapping, Params)) else None
    if not isinstance(layers, (list, tuple)):
        raise ValueError(
            f"stack_layers: params['layers'] must be a list of per-layer dicts (the unstacked form init_params and "
            f"load_checkpoint give), got {_what_layers(params)}; a dict of stacked leaves is stacked already"
        )
    out: dict[str, Any] = {
        k: (v if not isinstance(v, torch.Tensor) else v.unsqueeze(0).clone())
        for k, v in params.items()
        if k != "layers"
    }
    names = list(layers[0]) if layers else []
    for i, layer in enumerate(layers):
        if list(layer) != names:
            raise ValueError(
                f"stack_layers: layer {i} has leaves {list(layer)} but "
                f"layer 0 has {names}; every layer must have the same leaves"
            )
    return _like(params, out | {"layers": {k: torch.stack([layer[k] for layer in layers]) for k in names}})


def unstack_layers(stacked: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`stack_layers` (a list of per-layer dicts, top-level leaves without the leading dim)."""
    layers = _stacked_layers(stacked, "unstack_layers")
    out: dict[str, Any] = {}
    for k, v in stacked.items():
        if k == "layers":
            continue
        if isinstance(v, torch.Tensor) and v.shape[:1] != (1,):
            raise ValueError(
                f"unstack_layers: {k!r} has leading dim {tuple(v.shape[:1])}, "
                f"expected (1,); is this a pipeline stage that does not hold it?"
            )
        out[k] = v[0].clone() if isinstance(v, torch.Tensor) else v
    n = next((v.shape[0] for v in layers.values()), 0)
    return _like(stacked, out | {"layers": [{k: v[i].clone() for k, v in layers.items()} for i in range(n)]})


def _stacked_layers(stacked: Any, where: str) -> dict[str, torch.Tensor]:
    """``stacked['layers']``, checked to be stacked: a dict of tensors, each with a leading layer dim."""
    layers = stacked.get("layers") if isinstance(stacked, (Mapping, Params)) else None
    if not isinstance(layers, Mapping):
        raise ValueError(
            f"{where}: params['layers'] must be stacked, a dict of [num_layers, ...] leaves, got "
            f"{_what_layers(stacked)}; stack the params first: stack_layers(params)"
        )
    flat = next(((k, v) for k, v in layers.items() if not isinstance(v, torch.Tensor) or v.dim() < 1), None)
    if flat is not None:
        k, v = flat
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(
            f"{where}: params['layers'][{k!r}] is {shape}; a stacked layer leaf is a tensor [num_layers, ...] "
            f"(stack_layers' form)"
        )
    if len({v.shape[0] for v in layers.values()}) > 1:
        raise ValueError(
            f"{where}: the stacked layer leaves disagree on the layer count: "
            f"{ {k: v.shape[0] for k, v in layers.items()} }"
        )
    return dict(layers)


def _what_layers(params: Any) -> str:
    """What ``params['layers']`` is, in words (for the stacking errors)."""
    if not isinstance(params, (Mapping, Params)):
        return f"params of type {type(params).__name__}"
    if "layers" not in params:
        return "params with no 'layers'"
    layers = params["layers"]
    size = f" of {len(layers)} entries" if isinstance(layers, (list, tuple, Mapping)) else ""
    return f"a {type(layers).__name__}{size}"


def _like(params: Any, tree: dict[str, Any]) -> Any:
    """``tree`` as :class:`~functional_npu.core.params.Params` of ``params``' config if ``params`` is one (the
    placement does not carry over: the form is another), else as it is."""
    return Params(tree, params.config) if isinstance(params, Params) else tree


def stacked_specs(
    specs: Mapping[str, Any], layer_dim: DimSpec | None = None, top_dims: Mapping[str, DimSpec | None] | None = None
) -> dict[str, Any]:
    """The spec tree of the stacked form: each layout shifted by one dim, the new dim 0 being ``layer_dim``
    for layer leaves and ``top_dims[name]`` (default None: whole) for the others.

    Example (layer-sharded inference: layer l on dp coordinate l % n, TP inside each layer):
        >>> stacked_specs(llama.param_specs(cfg), Cyclic("dp", cfg.num_layers))   # doctest: +SKIP
    """
    layers = specs["layers"]
    if any(layer != layers[0] for layer in layers):
        raise ValueError("stacked_specs: every layer must have the same specs to be stacked")
    top = dict(top_dims or {})
    out: dict[str, Any] = {k: Layout((top.get(k),) + v.dims) for k, v in specs.items() if k != "layers"}
    return out | {"layers": {k: Layout((layer_dim,) + v.dims) for k, v in (layers[0] if layers else {}).items()}}


def megatron_pipeline_specs(
    cfg: Any, *, tp_axis: str = "tp", pp_axis: str = "pp", pp: int = 1, vpp: int = 1
) -> dict[str, Any]:
    """Megatron TP x PP (x virtual pipeline) layout of the stacked params (see the module docstring).

    Args:
        cfg: the model config.
        tp_axis, pp_axis: the mesh axes of Megatron's tensor- and pipeline-parallel groups.
        pp: the size of ``pp_axis`` (the last stage holds the final norm and the output layer).
        vpp: virtual pipeline chunks per stage.

    Returns:
        A spec tree over ``stack_layers(family.abstract_params(cfg))``.

    Example (TP=2 x PP=2 x vpp=2 training to layer-sharded inference on the same 4 ranks):
        >>> src = megatron_pipeline_specs(cfg, pp=2, vpp=2)                                  # doctest: +SKIP
        >>> dst = stacked_specs(llama.param_specs(cfg), Cyclic("pp", cfg.num_layers))          # doctest: +SKIP
        >>> local = reshard(from_megatron(chunks, cfg, src, mesh), src, dst, mesh)           # doctest: +SKIP

    Raises:
        TypeError / ValueError: a ``pp`` or ``vpp`` that is no int >= 1, or whose product does not divide the layers.
    """
    require_int(pp, "megatron_pipeline_specs: pp", 1)
    require_int(vpp, "megatron_pipeline_specs: vpp", 1)
    if cfg.num_layers % (pp * vpp):
        raise ValueError(
            f"megatron_pipeline_specs: {cfg.num_layers} layers cannot be cut into vpp={vpp} chunks over pp={pp} "
            f"stages (every stage holds num_layers / (pp * vpp) layers of each chunk); use a pp * vpp that divides "
            f"{cfg.num_layers}"
        )
    last = pp - 1
    top = {"embed": Cyclic(pp_axis, 1, 0), "norm": Cyclic(pp_axis, 1, last), "lm_head": Cyclic(pp_axis, 1, last)}
    return stacked_specs(megatron_specs(cfg, tp_axis=tp_axis), pipeline_dim(cfg.num_layers, pp_axis, vpp), top)


# ---- names ----------------------------------------------------------------------------------------
def _pattern(name: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(name).replace(re.escape("{i}"), r"(\d+)") + "$")


def _table(family: Family) -> list[tuple[re.Pattern[str], str]]:
    names, aliases = family.megatron.names, family.megatron.aliases
    return [(_pattern(m), ours) for m, ours in list(names.items()) + [(a, names[t]) for a, t in aliases.items()]]


def _our_path(name: str, table: list[tuple[re.Pattern[str], str]]) -> tuple[str, int | None]:
    """(our leaf name, local layer index or None) for a Megatron name; ValueError naming it if unknown."""
    for pat, ours in table:
        m = pat.match(name)
        if m:
            return (ours.split(".")[-1], int(m.group(1))) if m.groups() else (ours, None)
    raise ValueError(
        f"from_megatron: no entry for Megatron parameter {name!r} "
        f"in the family's Megatron names; add it to the table (or drop the key)"
    )


def from_megatron(
    chunks: Sequence[Mapping[str, torch.Tensor]],
    cfg: Any,
    specs: Mapping[str, Any],
    mesh: Mesh,
) -> dict[str, Any]:
    """This rank's stacked local tree from its Megatron state dicts (one per virtual chunk, layers numbered from 0).

    Collective on a mesh of several ranks (every rank calls it). Only renames and stacks: layer ``j`` of chunk
    ``v`` becomes local layer ``v * per_chunk + j``, matching :func:`pipeline_dim`. Leaves this stage does not
    hold come out with a leading dim of 0.

    Args:
        chunks: ``model[v].state_dict()`` of this rank for each virtual chunk ``v`` (names as in
            the family's ``megatron.names``).
        cfg: the model config.
        specs: the Megatron layout (from :func:`megatron_pipeline_specs`), for the local shapes.
        mesh: a mesh at this rank's coordinate.

    Returns:
        This rank's local tree in the stacked form, ready for ``reshard(tree, specs, dst, mesh)``.

    Raises:
        ValueError naming the Megatron parameter that is missing, unknown or of the wrong shape; on a mesh of
        several ranks, the same error on every rank (the ranks agree on their checks,
        :func:`~functional_npu.core.agree.agree`, so none goes on to an exchange that would wait for the others).
    """
    return agreed(mesh, _from_megatron, chunks, cfg, specs, mesh)


def _from_megatron(
    chunks: Sequence[Mapping[str, torch.Tensor]], cfg: Any, specs: Mapping[str, Any], mesh: Mesh
) -> dict[str, Any]:
    family = _megatron(cfg, "from_megatron")
    found, layers_per_chunk = _by_path(chunks, _table(family))
    out: dict[str, Any] = {}
    for path, meta in _leaves(stack_layers(family.abstract_params(cfg))):
        want = local_shape(meta.shape, _at(specs, path), mesh, path=path, dtype=meta.dtype)
        tensors = _entries(path, found.get(path, {}))
        _check_entries(path, tensors, want, mesh, layers_per_chunk)
        x = torch.stack([t for _, t in tensors]) if tensors else torch.empty(want, dtype=meta.dtype)
        out = _put(out, path, x)
    return Params(out, cfg)


def _by_path(
    chunks: Sequence[Mapping[str, torch.Tensor]], table: list[tuple[re.Pattern[str], str]]
) -> tuple[dict[str, dict[Any, tuple[str, torch.Tensor]]], list[int]]:
    """Our path -> {(chunk, local layer), or 0 for a top-level leaf: (Megatron name, tensor)}, and each
    chunk's layer count."""
    found: dict[str, dict[Any, tuple[str, torch.Tensor]]] = {}
    layers_per_chunk = []
    for v, sd in enumerate(chunks):
        idx = set()
        for name, x in sd.items():
            ours, i = _our_path(name, table)
            if i is None:
                found.setdefault(ours, {})[0] = (name, x)
            else:
                idx.add(i)
                found.setdefault("layers." + ours, {})[(v, i)] = (name, x)
        layers_per_chunk.append(len(idx))
    return found, layers_per_chunk


def _entries(path: str, got: Mapping[Any, tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """A leaf's (Megatron name, tensor) entries in stacking order: layers by (chunk, layer); a top-level
    leaf has one or none."""
    if path.startswith("layers."):
        return [got[k] for k in sorted(got)]
    return [got[0]] if got else []


def _check_entries(
    path: str, tensors: list[tuple[str, torch.Tensor]], want: tuple[int, ...], mesh: Mesh, layers_per_chunk: list[int]
) -> None:
    """As many entries as the local stacked shape ``want`` has on dim 0, each of shape ``want[1:]``."""
    if len(tensors) != want[0]:
        raise ValueError(
            f"from_megatron: {path!r} needs {want[0]} local entries on rank {mesh.rank} "
            f"{mesh.coordinate} but the state dicts hold {len(tensors)} (chunks with "
            f"{layers_per_chunk} layers); check the Megatron names, pp/vpp and the layout"
        )
    for name, t in tensors:
        if tuple(t.shape) != want[1:]:
            raise ValueError(
                f"from_megatron: {name!r} ({path!r}) is {tuple(t.shape)} on rank {mesh.rank} but its layout gives "
                f"{want[1:]} per entry; was it trained with another tp/pp, or is the config different?"
            )


def to_megatron(local: Mapping[str, Any], vpp: int = 1) -> list[dict[str, torch.Tensor]]:
    """The inverse of :func:`from_megatron`: one Megatron-named state dict per virtual chunk (layers
    numbered from 0).

    Raises:
        TypeError / ValueError: ``local`` that is not stacked (:func:`stack_layers`) or carries no config, a ``vpp``
        that is no int >= 1 or does not divide this stage's layers (the vpp its layout was made with does).
    """
    layers = _stacked_layers(local, "to_megatron")
    if getattr(local, "config", None) is None:
        raise TypeError(
            f"to_megatron: local must be a functional_npu.Params with its model config (from_megatron's, or "
            f"shard(stack_layers(params), specs, mesh)), got {type(local).__name__}"
        )
    n = next((v.shape[0] for v in layers.values()), 0)
    fix = " (the vpp its layout was made with: megatron_pipeline_specs(cfg, pp=..., vpp=...))"
    _check_chunks(n, vpp, "to_megatron", f"this stage's {n} layers", fix)
    chunks: list[dict[str, torch.Tensor]] = [{} for _ in range(vpp)]
    reverse = {ours: m for m, ours in _megatron(local.config, "to_megatron").megatron.names.items()}
    for k, x in local.items():
        if k == "layers" or not isinstance(x, torch.Tensor):  # static nodes (config, plan) have no Megatron name
            continue
        if x.shape[0]:
            chunks[0 if k == "embed" else vpp - 1][reverse[k]] = x[0].clone()
    for k, x in layers.items():
        per = x.shape[0] // vpp
        for v in range(vpp):
            for j in range(per):
                chunks[v][reverse["layers.{i}." + k].format(i=j)] = x[v * per + j].clone()
    return chunks


def _leaves(tree: Mapping[str, Any]):
    for k, v in tree.items():
        if k == "layers":
            yield from ((f"layers.{n}", x) for n, x in v.items())
        elif isinstance(v, torch.Tensor):
            yield k, v


def _at(specs: Mapping[str, Any], path: str) -> Layout:
    head, _, rest = path.partition(".")
    return specs[head][rest] if rest else specs[head]


def _put(tree: dict[str, Any], path: str, x: torch.Tensor) -> dict[str, Any]:
    head, _, rest = path.partition(".")
    if rest:
        return tree | {head: dict(tree.get(head, {})) | {rest: x}}
    return tree | {head: x}
