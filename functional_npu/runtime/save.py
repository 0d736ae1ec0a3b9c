"""Write full params as a HF model directory that transformers and ``load_checkpoint`` both read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..core.shard import leaf_specs
from ..core.tree import flatten_with_paths
from ..models import Family, family_of
from .hf_layout import block_ranges, fused_dim, stored_parts

__all__ = ["save_checkpoint"]


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
        for part in stored_parts(family, cfg, p, tuple(x.shape), layouts[p]):
            t = x if part.index is None else x[part.index]
            dim = fused_dim(part.layout)
            for name, (offset, size) in zip(
                part.names, block_ranges(part.layout, dim, t.shape[dim], len(part.names), path=p)
            ):
                tensors[name] = t.narrow(dim, offset, size).contiguous()
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    return root


def _check_savable(family: Family, cfg: Any, params: dict[str, Any]) -> None:
    """A derived leaf (an MoE expert map) must hold its default value: HF stores one tensor per logical expert."""
    for p, x in flatten_with_paths(params):
        make = (family.derived or {}).get(p.split(".")[-1])
        if make is not None and not torch.equal(x, make(cfg)):
            raise ValueError(
                f"save_checkpoint: params[{p!r}] holds an expert placement other than the identity "
                f"(shape {tuple(x.shape)}); HF checkpoints store each logical expert once: "
                f"move the experts back to the identity placement before saving"
            )
