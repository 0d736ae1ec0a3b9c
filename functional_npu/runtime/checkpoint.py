"""Load a HF model directory straight into this rank's shards.

Each rank reads only the slices its layouts give it (``safe_open(...).get_slice``), never a whole
tensor it does not own; q/k/v and gate/up are fused into their fused layouts as they are read.
Everything is checked before the first tensor byte is read: the architecture, that the mesh can
shard the config, and that every tensor the config needs is present with the right shape (and
nothing else is). On any error nothing is returned, so nothing is half-loaded.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..core.layout import Layout, Shard, dim_pieces, local_pieces, validate
from ..core.mesh import Mesh
from ..parallel.layer_shard import LayerShard, owned_layers, present, series_specs, stack_series
from ..models import Family, family_of
from ..core.shard import leaf_specs, local_shape
from ..core.tree import flatten_with_paths, map_with_path

__all__ = ["load_checkpoint", "save_checkpoint", "read_config", "check_plan", "with_expert_axes"]

# Tensors some checkpoints carry that the forward recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)



def read_config(path: str | Path) -> Any:
    """The model config of a HF directory (``config.json``), parsed by its architecture's family."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: expected a HF model directory (config.json + *.safetensors)")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    return family_of((hf.get("architectures") or [None])[0]).from_hf(hf)


def with_expert_axes(cfg: Any, expert_axes: Sequence[str], *, where: str = "model") -> Any:
    """``cfg`` with its experts sharded over ``expert_axes`` (MoE configs; ``()`` leaves any config as it is)."""
    if not expert_axes:
        return cfg
    if "expert_axes" not in {f.name for f in dataclasses.fields(cfg)}:
        raise ValueError(f"{where}: expert_axes={tuple(expert_axes)} needs a mixture-of-experts model, but this is a {cfg.architecture}; drop expert_axes (--ep)")
    return dataclasses.replace(cfg, expert_axes=tuple(expert_axes))


def check_plan(
    cfg: Any, mesh: Mesh, *, where: str = "model", layer_shard: LayerShard | None = None
) -> tuple[dict[str, Any], dict[str, Layout]]:
    """Raise a ValueError if ``mesh`` cannot shard ``cfg`` at any of its coordinates (no I/O).

    Returns:
        The full params on the meta device and each leaf's layout, for the caller to reuse; with
        ``layer_shard``, in the layer-sharded structure (series stacked under ``params["series"]``).
    """
    if "tp" not in mesh.axis_names:
        raise ValueError(f"{where}: the mesh {mesh.shape} has no 'tp' axis; add one (size 1 for no tensor parallelism)")
    family = family_of(cfg)
    meta, specs = family.abstract_params(cfg), family.param_specs(cfg)
    if layer_shard is not None:
        if family.name != "llama":
            raise ValueError(f"{where}: layer sharding supports the dense families, not {cfg.architecture}; drop layer_shard (--layer-shard)")
        if layer_shard.axis not in mesh.axis_names:
            raise ValueError(f"{where}: layer_shard axis {layer_shard.axis!r} is not an axis of the mesh {mesh.shape}; use one of {list(mesh.axis_names)}")
        meta, specs = stack_series(meta, layer_shard), series_specs(specs, layer_shard, cfg.num_layers)
    layouts = leaf_specs(specs, meta)
    for p, m in flatten_with_paths(meta):
        try:
            validate(p, layouts[p], m.shape, torch.float32, mesh.shape)
            for d, s in enumerate(layouts[p].dims):
                if s is not None:
                    n = mesh.axis_size(s.axes)
                    [dim_pieces(s, m.shape[d], n, c, f"specs[{p!r}]", d) for c in range(n)]
        except ValueError as e:
            raise ValueError(f"{where}: the mesh {mesh.shape} cannot shard this {cfg.architecture} config: {e}") from None
    return meta, layouts


def save_checkpoint(params: dict[str, Any], path: str | Path) -> Path:
    """Write full (unsharded) params as a HF model directory (config.json + model.safetensors).

    Fused leaves are split back into their HF tensors, so transformers and :func:`load_checkpoint`
    both read the result.
    """
    from safetensors.torch import save_file

    cfg = params["config"]
    family = family_of(cfg)
    _check_savable(family, cfg, params)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    layouts = leaf_specs(family.param_specs(cfg), params)
    tensors: dict[str, torch.Tensor] = {}
    for p, x in flatten_with_paths(params):
        for j, layout, _, sources in _parts(family, cfg, p, tuple(x.shape), layouts[p]):
            part = x if j is None else x[j]
            dim = _fused_dim(layout)
            for name, (offset, size) in zip(sources, _block_ranges(layout, dim, part.shape[dim], len(sources))):
                tensors[name] = part.narrow(dim, offset, size).contiguous()
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    return root


def _check_savable(family: Family, cfg: Any, params: dict[str, Any]) -> None:
    """A derived leaf (an MoE expert map) must hold its default value: HF stores one tensor per logical expert."""
    for p, x in flatten_with_paths(params):
        make = (family.derived or {}).get(p.split(".")[-1])
        if make is not None and not torch.equal(x, make(cfg)):
            raise ValueError(
                f"save_checkpoint: params[{p!r}] holds an expert placement other than the identity (shape {tuple(x.shape)}); "
                f"HF checkpoints store each logical expert once: move the experts back to the identity placement before saving"
            )


def _sources(family: Family, cfg: Any, path: str, j: int | None = None) -> list[str]:
    *parents, leaf = path.split(".")
    layer = parents[1] if parents[:1] == ["layers"] else None
    return [name.format(i=layer, j=j) for name in family.hf_names(cfg)[leaf]]


def _parts(family: Family, cfg: Any, path: str, shape: tuple[int, ...], layout: Layout) -> list[tuple[int | None, Layout, tuple[int, ...], list[str]]]:
    """The stored parts of one leaf as ``(index along dim 0 or None, layout, shape, HF names)``.

    A plain leaf is one part; a leaf stacked over experts has one part per expert ``j`` (its dims
    past 0); a derived leaf has none.
    """
    leaf = path.split(".")[-1]
    if leaf in (family.derived or {}):
        return []
    if leaf not in family.stacked:
        return [(None, layout, shape, _sources(family, cfg, path))]
    sub = Layout(layout.dims[1:])
    return [(j, sub, shape[1:], _sources(family, cfg, path, j)) for j in range(shape[0])]


def _weight_files(root: Path) -> dict[str, Path]:
    """HF tensor name -> file, from the sharded index or the single file."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({e!r})") from None
        return {name: root / file for name, file in weight_map.items()}
    single = root / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{root}: neither model.safetensors nor model.safetensors.index.json is present")
    return {name: single for name in _open(single).keys()}


def _open(file: Path):
    if not file.is_file():
        raise FileNotFoundError(f"{file} is named by the index but does not exist")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error type for bad headers
        raise ValueError(f"{file}: cannot read the safetensors file ({e}); it is truncated or corrupted, download it again") from None


def _block_ranges(layout: Layout, dim: int, full: int, n_sources: int) -> list[tuple[int, int]]:
    spec = layout.dims[dim] if dim < len(layout.dims) else None
    if n_sources == 1:
        return [(0, full)]
    if not (isinstance(spec, Shard) and spec.blocks):  # a fused dim kept whole (experts' [gate|up] without tp): equal blocks
        return [(i * (full // n_sources), full // n_sources) for i in range(n_sources)]
    assert len(spec.blocks) == n_sources  # guaranteed by the family's specs
    out, offset = [], 0
    for b in spec.blocks:
        out.append((offset, b.size // spec.pack))
        offset += b.size // spec.pack
    return out


def _fused_dim(layout: Layout) -> int:
    return next((d for d, s in enumerate(layout.dims) if isinstance(s, Shard) and s.blocks), 0)


def load_checkpoint(
    path: str | Path,
    mesh: Mesh,
    *,
    dtype: torch.dtype | None = None,
    progress: bool | None = None,
    on_read: Callable[[str, int], None] | None = None,
    expert_axes: Sequence[str] = (),
    layer_shard: LayerShard | None = None,
) -> dict[str, Any]:
    """Load a HF checkpoint of any supported family into this rank's local params.

    Args:
        path: a HF model directory: ``config.json`` and ``model.safetensors`` or a sharded index.
        mesh: a mesh with a ``tp`` axis (other axes hold replicas), from ``make_mesh`` or
            ``Mesh.abstract(...).at(...)`` to load one coordinate's shards in one process.
        dtype: convert to this dtype (default: as stored).
        progress: print progress on rank 0 (default: when stderr is a terminal).
        on_read: called as ``on_read(tensor_name, bytes_read)`` for every slice read.
        expert_axes: MoE models only: the mesh axes the experts are sharded over (expert
            parallelism, e.g. ``("dp", "tp")``); each rank reads only its experts' tensors.
        layer_shard: layer-shard these series (``layer_shard.layer_shard("o_proj,down_proj")``):
            layer ``l``'s weights are read only by coordinate ``l % n`` of its axis and stacked
            under ``params["series"]``; the forward fetches them with broadcasts.

    Returns:
        Params for the family's ``forward``: the local shards plus ``params["config"]``.

    Raises:
        ValueError / FileNotFoundError naming the file, tensor, param path, sizes and mesh axis.
    """
    root = Path(path)
    cfg = read_config(root)
    cfg = with_expert_axes(cfg, expert_axes, where=str(root))
    if mesh.rank is None:
        raise ValueError(f"load_checkpoint: mesh {mesh.shape} has no coordinate; use make_mesh(...) or mesh.at(rank)")
    meta, layouts = check_plan(cfg, mesh, where=str(root))
    if layer_shard is not None:
        check_plan(cfg, mesh, where=str(root), layer_shard=layer_shard)
    leaves = dict(flatten_with_paths(meta))
    skip = _not_owned(cfg, mesh, layer_shard, meta)

    files = _weight_files(root)
    handles = {f: _open(f) for f in sorted(set(files.values()))}
    family = family_of(cfg)
    _check_names_and_shapes(root, family, cfg, leaves, layouts, files, handles)

    show = (sys.stderr.isatty() if progress is None else progress) and mesh.rank == 0
    loaded: dict[str, torch.Tensor] = {}
    t0 = time.perf_counter()
    for k, (p, m) in enumerate(leaves.items()):
        if p in skip:
            continue
        loaded[p] = _read_leaf(family, cfg, p, tuple(m.shape), layouts[p], mesh, files, handles, on_read)
        if dtype is not None and loaded[p].is_floating_point():
            loaded[p] = loaded[p].to(dtype)
        if show:
            print(f"\rloading {root.name}: {k + 1}/{len(leaves)} tensors, {time.perf_counter() - t0:.1f}s", end="", file=sys.stderr, flush=True)
    if show:
        print(file=sys.stderr)
    if layer_shard is None:
        return map_with_path(lambda p, _: loaded[p], meta)
    return _stack_owned(cfg, mesh, layer_shard, meta, layouts, loaded)


def _not_owned(cfg: Any, mesh: Mesh, ls: LayerShard | None, meta: dict[str, Any]) -> set[str]:
    """Paths of the series leaves of layers this coordinate does not own (never read)."""
    if ls is None:
        return set()
    mine = set(owned_layers(cfg.num_layers, mesh.axis_size(ls.axis), mesh.axis_index(ls.axis)))
    return {f"layers.{i}.{leaf}" for i in range(cfg.num_layers) if i not in mine for leaf in ls.leaves if leaf in meta["layers"][i]}


def _stack_owned(cfg, mesh, ls, meta, layouts, loaded) -> dict[str, Any]:
    """The layer-sharded params: the owned layers of each series stacked in layer order."""
    mine = owned_layers(cfg.num_layers, mesh.axis_size(ls.axis), mesh.axis_index(ls.axis))
    leaves = present(ls, meta["layers"][0])
    series = {}
    for leaf in leaves:
        owned = [loaded[f"layers.{i}.{leaf}"] for i in mine]
        if owned:
            series[leaf] = torch.stack(owned)
        else:  # more ranks on the axis than layers: this one holds none
            path = f"layers.0.{leaf}"
            shape = local_shape(meta["layers"][0][leaf].shape, layouts[path], mesh, path=path)
            series[leaf] = torch.empty((0, *shape), dtype=loaded["embed"].dtype)
    layers = [{leaf: loaded[f"layers.{i}.{leaf}"] for leaf in layer if leaf not in leaves} for i, layer in enumerate(meta["layers"])]
    top = {k: loaded.get(k, v) for k, v in meta.items() if k != "layers"}
    return top | {"layers": layers, "series": series, "layer_shard": ls}


def _check_names_and_shapes(root, family, cfg, leaves, layouts, files, handles) -> None:
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    for p, m in leaves.items():
        for _, layout, full, sources in _parts(family, cfg, p, tuple(m.shape), layouts[p]):
            dim = _fused_dim(layout)
            for name, (_, size) in zip(sources, _block_ranges(layout, dim, full[dim], len(sources))):
                shape = list(full)
                shape[dim] = size
                expected[name] = (p, tuple(shape))
    missing = sorted(set(expected) - set(files))
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(n for n in set(files) - set(expected) - ignorable if not n.endswith(_IGNORED_SUFFIXES))
    if missing or unexpected:
        lines = [f"{root}: the checkpoint does not match its {cfg.architecture} config.json:"]
        if missing:
            lines.append(f"  missing tensors ({len(missing)}): " + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            lines.append(f"  unexpected tensors ({len(unexpected)}): " + ", ".join(unexpected[:20]) + (" ..." if len(unexpected) > 20 else ""))
        raise ValueError("\n".join(lines))
    for name, (p, shape) in expected.items():
        got = tuple(handles[files[name]].get_slice(name).get_shape())
        if got != shape:
            raise ValueError(
                f"{root}: tensor {name!r} (for params[{p!r}]) has shape {got} but config.json implies {shape} "
                f"({_sizes(cfg)}); the config and the weights disagree"
            )


def _sizes(cfg: Any) -> str:
    base = getattr(cfg, "base", cfg)  # an MoE config keeps its attention sizes in .base
    text = (f"hidden_size={base.hidden_size}, heads={base.num_heads}, kv_heads={base.num_kv_heads}, head_dim={base.head_dim}, "
            f"intermediate_size={base.intermediate_size}, vocab_size={base.vocab_size}")
    return text + (f", num_experts={cfg.num_experts}, moe_intermediate_size={cfg.moe_intermediate_size}" if base is not cfg else "")


def _read_leaf(family, cfg, path, full_shape, layout, mesh, files, handles, on_read) -> torch.Tensor:
    """This coordinate's shard of one param: read slice by slice from its HF tensors, or derived from the config."""
    leaf = path.split(".")[-1]
    if leaf in (family.derived or {}):
        return family.derived[leaf](cfg)
    pieces = local_pieces(path, layout, full_shape, mesh)
    pieces += [None] * (len(full_shape) - len(pieces))
    parts = _parts(family, cfg, path, full_shape, layout)
    if leaf not in family.stacked:
        return _read_part(full_shape, layout, pieces, parts[0][3], files, handles, on_read)
    mine = [j for a, b, step in pieces[0] or [(0, full_shape[0], 1)] for j in range(a, b, step)]  # this rank's experts
    return torch.stack([_read_part(parts[j][2], parts[j][1], pieces[1:], parts[j][3], files, handles, on_read) for j in mine])


def _read_part(full_shape, layout, pieces, sources, files, handles, on_read) -> torch.Tensor:
    dim = _fused_dim(layout)
    chunks = []
    for a, b, step in pieces[dim] or [(0, full_shape[dim], 1)]:
        for name, (offset, size) in zip(sources, _block_ranges(layout, dim, full_shape[dim], len(sources))):
            lo, hi = max(a, offset), min(b, offset + size)
            if lo >= hi:
                continue
            index = []
            for d in range(len(full_shape)):
                if d == dim:
                    index.append([slice(lo - offset, hi - offset, step)])
                else:
                    index.append([slice(*p) for p in pieces[d]] if pieces[d] else [slice(None)])
            chunks.append(_read_box(handles[files[name]].get_slice(name), index, on_read, name))
    return torch.cat(chunks, dim=dim) if len(chunks) > 1 else chunks[0]


def _read_box(tensor_slice, index: list[list[slice]], on_read, name: str) -> torch.Tensor:
    """Read the product of per-dim slice lists, concatenating along each dim that has several."""
    multi = next((d for d, sl in enumerate(index) if len(sl) > 1), None)
    if multi is None:
        t = tensor_slice[tuple(sl[0] for sl in index)]
        if on_read is not None:
            on_read(name, t.numel() * t.element_size())
        return t
    parts = [_read_box(tensor_slice, index[:multi] + [[sl]] + index[multi + 1 :], on_read, name) for sl in index[multi]]
    return torch.cat(parts, dim=multi)
