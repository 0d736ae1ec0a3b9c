"""torch.distributed.checkpoint (DCP) directories, read a box at a time: what FSDP2 / torchtitan users save.

A DCP directory holds ``.metadata`` (every tensor's global shape, dtype and stored chunks) and the
``__<rank>_<n>.distcp`` files the chunks were written to, each chunk one ``torch.save``\\ d tensor at a byte
range. :class:`DcpHandle` gives the loader the same interface as a safetensors file
(``get_slice(name)[box]``): a box is read from the chunks that overlap it, and no other chunk is opened, so
a rank reads only what its slices need whatever layout wrote the checkpoint (whole chunks: DCP stores no
finer unit). ``config.json`` (the model's HF config) sits beside ``.metadata``; tensor names are HF names,
as an HF model's ``state_dict()`` (FSDP2-wrapped or not) gives them.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["is_dcp", "DcpHandle", "DcpTensor"]

_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int8: "I8"}
_NAMES[torch.int32] = "I32"


def is_dcp(root: Path) -> bool:
    """Whether ``root`` is a DCP directory (it has ``.metadata``)."""
    return (root / ".metadata").is_file()


class DcpTensor:
    """One stored tensor, read by boxes (``tensor[slices]``) from the chunks that overlap them."""

    def __init__(self, handle: DcpHandle, name: str, meta: Any):
        self._handle, self._name, self._meta = handle, name, meta

    def get_shape(self) -> list[int]:
        return list(self._meta.size)

    def get_dtype(self) -> str:
        dtype = self._meta.properties.dtype
        return _NAMES.get(dtype, str(dtype))

    def __getitem__(self, index: Sequence[slice]) -> torch.Tensor:
        shape = self.get_shape()
        box = [s.indices(n)[:2] for s, n in zip(index, shape)] + [(0, n) for n in shape[len(index) :]]
        out = torch.empty([hi - lo for lo, hi in box], dtype=self._meta.properties.dtype)
        for chunk in self._meta.chunks:
            overlap = [
                (max(lo, o), min(hi, o + n)) for (lo, hi), o, n in zip(box, chunk.offsets, chunk.sizes)
            ]  # fmt: skip
            if any(a >= b for a, b in overlap):
                continue
            data = self._handle.read_chunk(self._name, chunk)
            src = tuple(slice(a - o, b - o) for (a, b), o in zip(overlap, chunk.offsets))
            dst = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(overlap, box))
            out[dst] = data[src]
        return out


class DcpHandle:
    """An opened DCP directory: tensor names, and chunks read on demand (``on_bytes(name, n)`` per chunk read)."""

    def __init__(self, root: Path, on_bytes: Callable[[str, int], None] | None = None):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

        self.root, self._on_bytes = root, on_bytes
        try:
            metadata = FileSystemReader(str(root)).read_metadata()
        except Exception as e:  # DCP raises its own error types for a bad file
            metadata = " ".join(str(e).split())[:160] or type(e).__name__
        if not isinstance(metadata, Metadata):
            why = metadata if isinstance(metadata, str) else f"it holds a {type(metadata).__name__}"
            raise ValueError(
                f"{root}/.metadata cannot be read as a DCP checkpoint ({why}); it is truncated or corrupted: "
                f"{_copy_again('.metadata')}"
            )
        self._tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self._storage = metadata.storage_data
        missing = sorted({i.relative_path for i in self._storage.values() if not (root / i.relative_path).is_file()})
        if missing:
            raise FileNotFoundError(
                f"{root}: the DCP checkpoint's .metadata names files that are missing: {', '.join(missing)}; "
                f"copy every rank's .distcp file"
            )
        for name, meta in self._tensors.items():
            covered = sum(math.prod(c.sizes) for c in meta.chunks)
            if covered != math.prod(meta.size):
                raise ValueError(
                    f"{root}: tensor {name!r} {tuple(meta.size)} has chunks covering {covered} of "
                    f"{math.prod(meta.size)} elements; a rank's shard is missing from the checkpoint"
                )
        self._check_byte_ranges()

    def _check_byte_ranges(self) -> None:
        """Every chunk has a file and lies inside it: a file cut short is named before anything is read."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        sizes: dict[str, int] = {}
        for name, meta in self._tensors.items():
            for chunk in meta.chunks:
                info = self._storage.get(MetadataIndex(name, chunk.offsets))
                if info is None:
                    raise ValueError(
                        f"{self.root}/.metadata lists a chunk of {name!r} at {tuple(chunk.offsets)} but no file "
                        f"holding it; .metadata does not belong to these .distcp files, save the checkpoint again"
                    )
                size = sizes.setdefault(info.relative_path, (self.root / info.relative_path).stat().st_size)
                if info.offset + info.length > size:
                    raise ValueError(
                        f"{self.root / info.relative_path} holds {size} bytes but .metadata places the chunk of "
                        f"{name!r} at bytes {info.offset}..{info.offset + info.length}; the file is truncated: "
                        f"{_copy_again(info.relative_path)}"
                    )

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_slice(self, name: str) -> DcpTensor:
        return DcpTensor(self, name, self._tensors[name])

    def read_chunk(self, name: str, chunk: Any) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self._storage[MetadataIndex(name, chunk.offsets)]
        file = self.root / info.relative_path
        if not file.is_file():
            raise FileNotFoundError(f"{self.root}: {info.relative_path} (holding a chunk of {name!r}) is missing")
        with open(file, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if self._on_bytes is not None:
            self._on_bytes(name, len(data))
        where = (
            f"{file} bytes {info.offset}..{info.offset + info.length} (the chunk of {name!r} at {tuple(chunk.offsets)})"
        )
        return _tensor_of(data, where, tuple(chunk.sizes), self._tensors[name].properties.dtype, info.relative_path)


def _copy_again(file: str) -> str:
    return f"copy {file} again from where the checkpoint was saved (or save the checkpoint again)"


def _tensor_of(data: bytes, where: str, shape: tuple[int, ...], dtype: torch.dtype, file: str) -> torch.Tensor:
    """The tensor ``torch.save`` wrote in ``data``, checked against the shape and dtype ``.metadata`` gives it;
    anything else (a short read, bytes that do not unpickle, another tensor) is one line naming ``where``."""
    fix = f"the file is corrupted: {_copy_again(file)}"
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # EOFError, UnpicklingError, RuntimeError...: bytes that are not a saved tensor
        first = (str(e).strip().splitlines() or [""])[0][:100]
        why = type(e).__name__ if not first or "weights_only" in first else f"{type(e).__name__}: {first}"
        raise ValueError(f"{where} is not a saved tensor ({why}); {fix}") from None
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
        got = f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{where} holds {got} but .metadata says {dtype} {shape}; {fix}")
    return tensor
