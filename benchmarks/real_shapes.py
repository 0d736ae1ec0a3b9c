"""Models at the shapes of released ones (:data:`benchmarks.configs.REAL`), built on the device they run on: this
library's params and transformers' model from one config, random weights (std 0.02, norms 1), nothing downloaded and
nothing written to disk. Before either is built, :func:`refusal` says in one line whether the device has the memory
both need (the figure it needed and the figure it has), so a cell that cannot run is skipped, never half-measured."""

from __future__ import annotations

import os
from typing import Any

import torch

from functional_npu.core import Mesh, Params, flatten_with_paths, map_with_path
from functional_npu.models.llama import LlamaConfig, abstract_params
from functional_npu.placement import place

__all__ = ["device_params", "peer_model", "needed_bytes", "available_bytes", "refusal", "param_count"]

GIB = 2**30


def param_count(cfg: LlamaConfig) -> int:
    """Parameters of the full model (embedding and untied head included), counted on the meta device."""
    return sum(x.numel() for _, x in flatten_with_paths(abstract_params(cfg)))


def device_params(cfg: LlamaConfig, dtype: torch.dtype, device: str, seed: int = 0) -> Params:
    """This library's full params of ``cfg`` in ``dtype``, made on ``device`` and placed on one rank."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def fill(path: str, x: torch.Tensor) -> torch.Tensor:
        return x.fill_(1.0) if path.endswith("norm") else x.normal_(0.0, 0.02, generator=gen)

    with torch.no_grad():
        params = map_with_path(fill, abstract_params(cfg, dtype=dtype, device=device))
    return params.placed(place(cfg, Mesh.abstract({"tp": 1}, 0)))


def peer_model(cfg: LlamaConfig, dtype: torch.dtype, device: str, seed: int = 0) -> Any:
    """transformers' model of ``cfg`` (its own class for the architecture, from the same ``config.json`` fields this
    library writes) in ``dtype``, initialized on ``device`` by transformers."""
    import transformers as T

    hf = cfg.to_hf()
    torch.manual_seed(seed)
    with torch.device(device):
        model = T.AutoModelForCausalLM.from_config(T.CONFIG_MAPPING[hf["model_type"]](**hf), dtype=dtype)
    return model.eval()


def needed_bytes(cfg: LlamaConfig, dtype: torch.dtype, batch: int, positions: int, systems: int = 2) -> int:
    """Memory ``systems`` copies of the model need at once: the weights and a KV cache of ``positions`` for ``batch``
    sequences each, plus a step's float32 logits. Compiler workspace comes on top."""
    kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * positions * dtype.itemsize
    logits = batch * cfg.vocab_size * 4
    return systems * (param_count(cfg) * dtype.itemsize + kv + logits)


def available_bytes(device: str) -> int:
    """Free memory on ``device``: the CUDA allocator's free figure, or the host's ``MemAvailable``."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 if "MemAvailable" in fields else _physical_free()


def _physical_free() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def refusal(name: str, need: int, free: int, device: str) -> str | None:
    """One line saying why a cell is skipped (``need`` bytes, ``free`` on ``device``), or None when it fits."""
    if need <= free:
        return None
    return (
        f"{name}: needs {need / GIB:.1f} GiB of {device} memory (two systems' weights, caches and logits), "
        f"{free / GIB:.1f} GiB free; skipped"
    )
