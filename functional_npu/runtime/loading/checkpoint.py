"""Load a HF model directory straight into this rank's shards.

Each rank reads only the slices its layouts give it (``safe_open(...).get_slice``), never a whole
tensor it does not own; q/k/v and gate/up are fused into their fused layouts as they are read.
Everything is checked before the first tensor byte is read: the architecture, that the mesh can
shard the config, and that every tensor the config needs is present with the right shape (and
nothing else is). On any error nothing is returned, so nothing is half-loaded.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from ...core.agree import agreed
from ...core.dtypes import float_dtype
from ...core.layout import Layout, local_pieces
from ...core.mesh import Mesh
from ...core.params import Params
from ...core.schema import show
from ...core.shard import local_shape
from ...core.tree import flatten_with_paths, map_with_path
from ...models import Family, family_of
from ...parallel.layer_shard import LayerShard, owned_layers, present
from ...parallel.offload import check_host_memory, pinned
from ...parallel.plan import Plan
from ...placement.hf_layout import StoredPart, block_ranges, family_leaf, fused_dim, stored_parts, stored_tensors
from ...placement.placement import Placement, place
from ...placement.quant_config import QuantConfig, read_quant_config
from ...placement.ring_memory import check_ring_budget, warn_ring_memory
from .dcp import DcpHandle, is_dcp

__all__ = ["load_checkpoint", "read_config", "read_quant"]

# safetensors dtype names of the weights a model may hold, and their torch dtypes
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}

_INT_DTYPES = {"I8": torch.int8, "I32": torch.int32}

# Tensors some checkpoints carry that the forward recomputes; a packed weight's logical shape.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_QUANT_IGNORED_SUFFIXES = (".weight_shape",)


@dataclass(frozen=True, slots=True)
class _Wanted:
    """What the config needs, in the per-layer form the files store: every leaf's full (meta) tensor and layout, and
    the placement they come from."""

    family: Family
    cfg: Any
    meta: dict[str, Any]
    leaves: dict[str, torch.Tensor]
    layouts: Mapping[str, Layout]
    quant: QuantConfig | None
    placement: Placement


@dataclass(frozen=True, slots=True)
class _Checkpoint:
    """An opened HF directory: the file of each HF tensor, an open handle per file, the read callback."""

    root: Path
    files: Mapping[str, Path]
    handles: Mapping[Path, Any]
    on_read: Callable[[str, int], None] | None

    def get_slice(self, name: str) -> Any:
        """The lazily read safetensors slice of one HF tensor."""
        file = self.files[name]
        try:
            return self.handles[file].get_slice(name)
        except Exception as e:  # safetensors raises its own error type for a name the file lacks
            raise ValueError(
                f"{self.root}: the index says tensor {name!r} is in {file.name}, but that file does not hold it "
                f"({' '.join(str(e).split())}); the index and the shards disagree, download them again"
            ) from None


def _read_hf(path: str | Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: expected a HF model directory (config.json + *.safetensors)")
    hf = _json_file(file, "download the model's config.json again")
    if not isinstance(hf, dict):
        raise ValueError(
            f"{file} holds a JSON {_JSON_TYPES.get(type(hf), 'value')}, not an object of the model's settings; "
            f"download the model's config.json again"
        )
    return hf


_JSON_TYPES = {list: "array", str: "string", type(None): "null", int: "number", float: "number", bool: "boolean"}


def _json_file(file: Path, fix: str) -> Any:
    """The JSON value in ``file``; a file that is not UTF-8 JSON is one line naming it and the fix."""
    try:
        return json.loads(file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({' '.join(str(e).split())[:120]}); {fix}") from None


def read_config(path: str | Path) -> Any:
    """The model config of a HF directory (``config.json``), parsed and checked by its architecture's family (one
    line naming the file and the field for anything malformed)."""
    hf, where = _read_hf(path), str(Path(path) / "config.json")
    given = hf.get("architectures")
    arch = given[0] if isinstance(given, list) and given and isinstance(given[0], str) else None
    try:
        family = family_of(arch)
    except ValueError as e:
        hint = "" if arch or given is None else f" (architectures is {show(given)}: give a list of class names)"
        raise ValueError(f"{where}: {e}{hint}") from None
    return family.from_hf(hf, where)


def read_quant(path: str | Path) -> QuantConfig | None:
    """The quantization of a HF directory's weights (``config.json``'s ``quantization_config``), None if float."""
    return read_quant_config(_read_hf(path), str(Path(path) / "config.json"))


def load_checkpoint(
    path: str | Path,
    mesh: Mesh,
    plan: Plan | Placement | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    progress: bool | None = None,
    on_read: Callable[[str, int], None] | None = None,
) -> Params:
    """Load a HF checkpoint of any supported family into this rank's local params.

    Args:
        path: a HF model directory: ``config.json`` and ``model.safetensors`` or a sharded index; or a
            torch.distributed.checkpoint directory (``.metadata`` and ``*.distcp``, as FSDP2 / torchtitan save
            an HF model's ``state_dict()``) with the model's ``config.json`` beside it
            (:mod:`functional_npu.runtime.loading.dcp`).
        mesh: a mesh with the plan's axes (other axes hold replicas), from ``make_mesh`` or
            ``Mesh.abstract(...).at(...)`` to load one coordinate's shards in one process.
        plan: where each piece lives (:class:`~functional_npu.parallel.plan.Plan`; default ``Plan()``:
            tensor parallelism over ``"tp"``), checked against the model and the mesh before any byte is
            read; or a :class:`~functional_npu.placement.Placement` already checked (of this checkpoint's config
            and quantization, for ``mesh``'s axes). Each rank reads only its slices: its experts' tensors over
            ``plan.expert_axes``, its module-TP slices, and with ``plan.layer_shard`` only the layers ``l`` it owns
            (``l % n``), stacked under ``params["series"]`` (the forward fetches them with broadcasts).
        dtype: read floating weights in this dtype (default: the embedding's stored dtype, so a
            checkpoint holding a stray fp16 tensor among fp32 ones loads in one dtype). A quantized
            checkpoint's integer tensors keep theirs; its scales take this one.
        device: where the params are put, each tensor as it is read (default: the CPU): ``"cuda"`` runs the
            compiled model on the GPU.
        progress: a progress bar (tqdm, on stderr) on rank 0; default: when stderr is a terminal.
        on_read: called as ``on_read(tensor_name, bytes_read)`` for every slice read.

    A compressed-tensors checkpoint (``quantization_config`` in ``config.json``; see
    :mod:`functional_npu.placement.quant_config`) loads its quantized linears as the dicts of their stored
    tensors, sharded like any leaf (:mod:`functional_npu.placement.quant_layouts`), the scheme in the placement;
    :func:`functional_npu.compile_model` puts them in their kernels' forms.

    Returns:
        :class:`~functional_npu.core.params.Params` for the family's ``forward``: the local shards, the config
        (``params.config``) and ``params.placement`` (the :class:`~functional_npu.placement.Placement` they were read
        by: the resolved plan, the mesh's axes, the quantization and every leaf's layout, which ``compile_model`` and
        the training entry points take).

    Raises:
        ValueError / FileNotFoundError naming the file, tensor, param path, sizes and mesh axis; with a mesh of
        several ranks (from ``make_mesh``: every rank calls it), the same error on every rank, since each rank's
        files may differ (:func:`~functional_npu.core.agree.agree`).
    """
    return agreed(mesh, _load, path, mesh, plan, dtype, device, progress, on_read)


def _device(device: Any) -> torch.device:
    """``device`` as a torch.device this process can allocate on; one line naming it otherwise."""
    try:
        out = torch.device("cpu" if device is None else device)
        torch.empty(0, device=out)
    except (RuntimeError, TypeError, AssertionError) as e:
        raise ValueError(
            f"load_checkpoint: device {device!r} is not usable here ({' '.join(str(e).split())[:160]}); "
            f"pass 'cpu' or a device this machine has"
        ) from None
    return out


def _load(
    path: str | Path,
    mesh: Mesh,
    plan: Plan | Placement | None,
    dtype: torch.dtype | None,
    device: Any,
    progress: bool | None,
    on_read: Callable[[str, int], None] | None,
) -> Params:
    """:func:`load_checkpoint` on this rank alone."""
    root = Path(path)
    dtype = None if dtype is None else float_dtype(dtype, "load_checkpoint")
    device = _device(device)
    wanted = _check_plan(root, mesh, plan)
    # the series' owned layers plus the prefetch ring against replication (prefetch_step "auto": compile_model's)
    warn_ring_memory(wanted.placement, "load_checkpoint", stacklevel=4)  # the caller of load_checkpoint
    layer_shard = wanted.placement.plan.layer_shard  # the series as leaves
    offload = wanted.placement.plan.offload  # the series kept in host memory, as leaves
    ckpt = _open_checkpoint(root, on_read)
    stored_dtype = _check_names_and_shapes(ckpt, wanted)
    check_ring_budget(wanted.placement, "load_checkpoint", dtype or stored_dtype)  # before any weight is read
    if offload:
        check_host_memory(_host_need(wanted, mesh, dtype or stored_dtype), f"load_checkpoint({root})")
    show = (sys.stderr.isatty() if progress is None else progress) and mesh.rank == 0
    skip = _not_owned(wanted, mesh, layer_shard)
    loaded = _read_leaves(ckpt, wanted, mesh, skip, dtype or stored_dtype, device, show, offload)
    if layer_shard is None and not offload:
        tree = map_with_path(lambda p, _: loaded[p], wanted.meta).tree
    else:
        tree = _stack_owned(wanted, mesh, layer_shard, loaded, offload, device)
    return Params(tree, placement=wanted.placement)


# ---- check ------------------------------------------------------------------------------------
def _check_plan(root: Path, mesh: Mesh, plan: Plan | Placement | None) -> _Wanted:
    """The config, its placement and what it needs, once the plan is known to fit it and the mesh (reads config.json
    only)."""
    cfg = read_config(root)
    quant = read_quant(root)
    if mesh.rank is None:
        raise ValueError(f"load_checkpoint: mesh {mesh.shape} has no coordinate; use make_mesh(...) or mesh.at(rank)")
    if isinstance(plan, Placement):  # checked already (the CLI's, made before the ranks started)
        placed = plan
        placed.fits(mesh, str(root))
        if placed.config != cfg or placed.quant != quant:
            raise ValueError(
                f"{root}: the placement was made for another model ({placed.describe()}); place this checkpoint's "
                f"config ({cfg.architecture}) instead"
            )
    else:
        placed = place(cfg, mesh, plan, quant, where=str(root))
    meta, layouts = placed.stored  # the files hold the per-layer form
    return _Wanted(family_of(cfg), cfg, meta, dict(flatten_with_paths(meta)), layouts, quant, placed)


def _open_checkpoint(root: Path, on_read: Callable[[str, int], None] | None) -> _Checkpoint:
    if is_dcp(root):  # a torch.distributed.checkpoint directory: boxes read from the chunks that overlap them
        handle = DcpHandle(root)
        return _Checkpoint(
            root, dict.fromkeys(handle.keys(), root / ".metadata"), {root / ".metadata": handle}, on_read
        )
    files = _weight_files(root)
    return _Checkpoint(root, files, {f: _open(f) for f in sorted(set(files.values()))}, on_read)


def _weight_files(root: Path) -> dict[str, Path]:
    """HF tensor name -> file, from the sharded index or the single file."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json_file(index, "download the index again")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(
                f'{index} is not a valid safetensors index (no "weight_map" object of tensor name -> file name); '
                f"download the index again"
            )
        return {name: root / file for name, file in weight_map.items()}
    single = root / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(
            f"{root}: neither model.safetensors, model.safetensors.index.json nor a DCP .metadata is present"
        )
    return {name: single for name in _open(single).keys()}


def _open(file: Path):
    if not file.is_file():
        raise FileNotFoundError(f"{file} is named by the index but does not exist")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error type for bad headers
        raise ValueError(
            f"{file}: cannot read the safetensors file ({e}); it is truncated or corrupted, download it again"
        ) from None


def _check_names_and_shapes(ckpt: _Checkpoint, wanted: _Wanted) -> torch.dtype:
    """Check every tensor the config needs is there, with its shape and dtype (floating point, or the integer
    type of a quantized weight); returns the embedding's dtype, which every float leaf is read in unless the
    caller asks for another."""
    expected = _expected_tensors(wanted, ckpt.files)
    _check_names(ckpt, wanted, expected)
    embed_dtype = torch.float32
    for name, (p, shape) in expected.items():
        stored = ckpt.get_slice(name)
        got = tuple(stored.get_shape())
        as_quant = f", stored as {wanted.quant.quant!r}" if family_leaf(p)[1] else ""
        if got != shape:
            raise ValueError(
                f"{ckpt.root}: tensor {name!r} (for params[{p!r}]{as_quant}) has shape {got} but config.json implies "
                f"{shape} ({_sizes(wanted.cfg)}); the config and the weights disagree"
            )
        kind, want = stored.get_dtype(), wanted.leaves[p].dtype
        if want.is_floating_point and kind not in _FLOAT_DTYPES:
            raise ValueError(
                f"{ckpt.root}: tensor {name!r} (for params[{p!r}]) is stored as {kind}, but weights are floating point "
                f"({', '.join(_FLOAT_DTYPES)}); the file was not written from this model's weights"
            )
        if not want.is_floating_point and _INT_DTYPES.get(kind) != want:
            raise ValueError(
                f"{ckpt.root}: tensor {name!r} (for params[{p!r}]{as_quant}) is stored as {kind}, but "
                f"quantization_config implies {want}; the config and the weights disagree"
            )
        if p == "embed":
            embed_dtype = _FLOAT_DTYPES[kind]
    return embed_dtype


def _expected_tensors(wanted: _Wanted, present: Collection[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF tensor name -> (the param path it belongs to, its shape), for every stored tensor the config needs."""
    stored = stored_tensors(wanted.family, wanted.cfg, wanted.leaves, wanted.layouts, present)
    return {name: (t.path, t.shape) for name, t in stored.items()}


def _check_names(ckpt: _Checkpoint, wanted: _Wanted, expected: Mapping[str, Any]) -> None:
    cfg = wanted.cfg
    missing = sorted(set(expected) - set(ckpt.files))
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    suffixes = _IGNORED_SUFFIXES + (_QUANT_IGNORED_SUFFIXES if wanted.quant else ())
    unread = wanted.family.unread(cfg)  # stored, not run (e.g. multi-token-prediction layers): not read
    unexpected = sorted(
        n for n in set(ckpt.files) - set(expected) - ignorable if not n.endswith(suffixes) and not n.startswith(unread)
    )
    if missing or unexpected:
        scheme = f" ({wanted.quant.quant!r})" if wanted.quant else ""
        lines = [f"{ckpt.root}: the checkpoint does not match its {cfg.architecture} config.json{scheme}:"]
        if missing:
            lines.append(
                f"  missing tensors ({len(missing)}): "
                + ", ".join(missing[:20])
                + (" ..." if len(missing) > 20 else "")
            )
        if unexpected:
            lines.append(
                f"  unexpected tensors ({len(unexpected)}): "
                + ", ".join(unexpected[:20])
                + (" ..." if len(unexpected) > 20 else "")
            )
        raise ValueError("\n".join(lines))


def _sizes(cfg: Any) -> str:
    """The config's sizes that fix tensor shapes (the family's ``sizes``), as ``field=value, ...``."""
    return ", ".join(f"{f}={v}" for f, v in family_of(cfg).sizes(cfg).items())


# ---- read -------------------------------------------------------------------------------------
def _read_leaves(
    ckpt: _Checkpoint,
    wanted: _Wanted,
    mesh: Mesh,
    skip: set[str],
    dtype: torch.dtype | None,
    device: torch.device,
    show: bool,
    offload: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """This coordinate's shard of every leaf not in ``skip``, converted to ``dtype`` and put on ``device`` (the
    ``offload`` series' leaves kept in host memory); progress on stderr if ``show``."""
    loaded: dict[str, torch.Tensor] = {}
    bar = tqdm(total=len(wanted.leaves), desc=f"loading {ckpt.root.name}", unit="tensor", disable=not show)
    with bar:
        for p in wanted.leaves:
            if p not in skip:
                x = _read_leaf(ckpt, wanted, p, mesh)
                x = x.to(dtype) if dtype is not None and x.is_floating_point() else x
                host = p.startswith("layers.") and p.split(".")[2] in offload
                loaded[p] = x if host else x.to(device)
            bar.update()
    return loaded


def _read_leaf(ckpt: _Checkpoint, wanted: _Wanted, path: str, mesh: Mesh) -> torch.Tensor:
    """This coordinate's shard of one param: read slice by slice from its HF tensors, or derived from the config."""
    family, (leaf, _) = wanted.family, family_leaf(path)
    if leaf in (family.derived or {}):
        return family.derived[leaf](wanted.cfg)
    full_shape, layout = tuple(wanted.leaves[path].shape), wanted.layouts[path]
    pieces = local_pieces(path, layout, full_shape, mesh)
    pieces += [None] * (len(full_shape) - len(pieces))
    parts = stored_parts(family, wanted.cfg, path, full_shape, layout, ckpt.files)
    if leaf not in family.stacked or parts[0].index is None:  # one part (fused experts held whole included)
        return _read_part(ckpt, parts[0], pieces)
    mine = [j for a, b, step in pieces[0] or [(0, full_shape[0], 1)] for j in range(a, b, step)]  # this rank's experts
    return torch.stack([_read_part(ckpt, parts[j], pieces[1:]) for j in mine])


def _read_part(ckpt: _Checkpoint, part: StoredPart, pieces: list) -> torch.Tensor:
    """The slices ``pieces`` (per dim, None: whole) of one stored part, read block by block from its HF tensors."""
    dim, full_shape = fused_dim(part.layout), part.shape
    chunks = []
    for a, b, step in pieces[dim] or [(0, full_shape[dim], 1)]:
        for name, (offset, size) in zip(
            part.names, block_ranges(part.layout, dim, full_shape[dim], len(part.names), path=part.path)
        ):
            lo, hi = max(a, offset), min(b, offset + size)
            if lo >= hi:
                continue
            index = []
            for d in range(len(full_shape)):
                if d == dim:
                    index.append([slice(lo - offset, hi - offset, step)])
                else:
                    index.append([slice(*p) for p in pieces[d]] if pieces[d] else [slice(None)])
            chunks.append(_read_box(ckpt.get_slice(name), index, ckpt.on_read, name))
    return torch.cat(chunks, dim=dim) if len(chunks) > 1 else chunks[0]


def _read_box(tensor_slice, index: list[list[slice]], on_read, name: str) -> torch.Tensor:
    """Read the product of per-dim slice lists, concatenating along each dim that has several."""
    multi = next((d for d, sl in enumerate(index) if len(sl) > 1), None)
    if multi is None:
        t = tensor_slice[tuple(sl[0] for sl in index)]
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():  # a column slice viewing every row read
            t = t.clone(memory_format=torch.contiguous_format)
        if on_read is not None:
            on_read(name, t.numel() * t.element_size())
        return t
    parts = [_read_box(tensor_slice, index[:multi] + [[sl]] + index[multi + 1 :], on_read, name) for sl in index[multi]]
    return torch.cat(parts, dim=multi)


def _host_need(wanted: _Wanted, mesh: Mesh, dtype: torch.dtype) -> int:
    """Bytes this rank keeps in host memory for the offloaded series (its tensor-parallel shard of every layer)."""
    total = 0
    for path, m in flatten_with_paths(wanted.placement.meta.get("host") or {}):
        shape = local_shape(m.shape, wanted.placement.layouts[f"host.{path}"], mesh, path=f"host.{path}")
        total += math.prod(shape) * (dtype.itemsize if m.is_floating_point() else m.element_size())
    return total


# ---- assemble (layer sharding) ----------------------------------------------------------------
def _not_owned(wanted: _Wanted, mesh: Mesh, ls: LayerShard | None) -> set[str]:
    """Paths of the series leaves (and a quantized leaf's stored tensors) of layers this coordinate does not
    own (never read)."""
    if ls is None:
        return set()
    num_layers, series = wanted.cfg.num_layers, present(ls, wanted.meta["layers"])
    mine = set(owned_layers(num_layers, mesh.axis_size(ls.axis), mesh.axis_index(ls.axis)))
    skip = {f"layers.{i}.{leaf}" for i in range(num_layers) if i not in mine for leaf in series}
    return {p for p in wanted.leaves if p in skip or p.rpartition(".")[0] in skip}


def _stack_owned(
    wanted: _Wanted,
    mesh: Mesh,
    ls: LayerShard | None,
    loaded: dict[str, torch.Tensor],
    offload: tuple[str, ...] = (),
    device: torch.device | None = None,
) -> dict[str, Any]:
    """The layer-sharded params: the owned layers of each series stacked in layer order, and every layer of each
    ``offload`` series stacked in host memory (pinned where ``device`` has pinned memory)."""
    meta = wanted.meta
    num_layers = wanted.cfg.num_layers
    mine = owned_layers(num_layers, mesh.axis_size(ls.axis), mesh.axis_index(ls.axis)) if ls is not None else []
    leaves = present(ls, meta["layers"]) if ls is not None else ()  # leaves every layer has (MoE: not experts)

    def leaf_of(i: int, leaf: str) -> Any:
        return _assembled(loaded, f"layers.{i}.{leaf}", meta["layers"][i][leaf])

    def empty(sub: str, m: torch.Tensor) -> torch.Tensor:  # more ranks on the axis than layers: none held
        path = f"layers.0.{leaf}.{sub}" if sub else f"layers.0.{leaf}"
        shape = local_shape(m.shape, wanted.layouts[path], mesh, path=path)
        dtype = loaded["embed"].dtype if m.is_floating_point() else m.dtype
        return torch.empty((0, *shape), dtype=dtype, device=loaded["embed"].device)

    series = {}
    for leaf in leaves:
        owned = [leaf_of(i, leaf) for i in mine]
        if owned:
            series[leaf] = map_with_path(lambda _, *xs: torch.stack(xs), *owned)
        else:
            series[leaf] = map_with_path(empty, meta["layers"][0][leaf])
    host = {}
    for leaf in offload:
        every = [leaf_of(i, leaf) for i in range(num_layers)]
        host[leaf] = map_with_path(lambda _, *xs: pinned(torch.stack(xs), device or xs[0].device), *every)
    layers = [
        {leaf: leaf_of(i, leaf) for leaf in layer if leaf not in leaves and leaf not in offload}
        for i, layer in enumerate(meta["layers"])
    ]
    top = {k: _assembled(loaded, k, v) for k, v in meta.items() if k != "layers"}
    return top | {"layers": layers} | ({"series": series} if ls is not None else {}) | ({"host": host} if host else {})


def _assembled(loaded: dict[str, torch.Tensor], path: str, structure: Any) -> Any:
    """The loaded tensor at ``path``, or the tree of them shaped like ``structure`` (a quantized leaf's dict;
    static nodes such as the config come back as they are)."""
    return map_with_path(lambda sub, _: loaded[f"{path}.{sub}" if sub else path], structure)
