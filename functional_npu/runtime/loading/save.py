"""Write full params as a HF model directory that transformers and ``load_checkpoint`` both read,
optionally quantized as compressed-tensors writes it (what llm-compressor writes and vLLM reads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ...core.params import Params
from ...core.quant import Quant, quantize
from ...core.shard import leaf_specs
from ...core.tree import flatten_with_paths
from ...models import Family, family_of
from ...placement.hf_layout import block_ranges, fused_dim, hf_sources, stored_parts
from ...placement.quant_config import QuantConfig

__all__ = ["save_checkpoint"]


def save_checkpoint(params: Params, path: str | Path, *, quant: Quant | QuantConfig | None = None) -> Path:
    """Write full (unsharded) params as a HF model directory (config.json + model.safetensors).

    Fused leaves are split back into their HF tensors, so transformers and :func:`load_checkpoint`
    both read the result. With ``quant``, every linear module it covers (a :class:`Quant`: all but
    ``lm_head`` and MoE routers) is quantized on its own, as compressed-tensors does
    (:func:`functional_npu.core.quant.quantize`, bit for bit): ``weight`` or ``weight_packed``,
    ``weight_scale``, ``weight_zero_point`` and (packed) ``weight_shape`` per module, and ``config.json``
    gets the ``quantization_config``.
    """
    from safetensors.torch import save_file

    if not isinstance(params, Params):
        raise TypeError(
            f"save_checkpoint: params must be a functional_npu.Params (the full tree with its config), got "
            f"{type(params).__name__}; a family's init_params makes one, or Params(tree, config)"
        )
    cfg = params.config
    family = family_of(cfg)
    _check_savable(family, cfg, params)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    layouts = leaf_specs(family.param_specs(cfg), params)
    if isinstance(quant, Quant):
        routers = [
            n.removesuffix(".weight")
            for p, _ in flatten_with_paths(params)
            if p.endswith("router")
            for n in hf_sources(family, cfg, p)
        ]
        quant = QuantConfig.of(quant, ("lm_head", *routers))
    tensors: dict[str, torch.Tensor] = {}
    for p, x in flatten_with_paths(params):
        linear = p.split(".")[-1] in family.linears
        for part in stored_parts(family, cfg, p, tuple(x.shape), layouts[p]):
            t = x if part.index is None else x[part.index]
            dim = fused_dim(part.layout)
            for name, (offset, size) in zip(
                part.names, block_ranges(part.layout, dim, t.shape[dim], len(part.names), path=p)
            ):
                w = t.narrow(dim, offset, size).contiguous()
                module = name.removesuffix(".weight")
                if quant is None or not linear or not quant.applies_to(module):
                    tensors[name] = w
                    continue
                try:
                    stored = quantize(w, quant.quant)
                except ValueError as e:
                    raise ValueError(f"save_checkpoint: {name} (params[{p!r}]) as {quant.quant!r}: {e}") from None
                tensors |= {f"{module}.{k}": v.contiguous() for k, v in stored.items()}
                if quant.quant.packed:  # the logical shape, as compressed-tensors records it for packed weights
                    tensors[f"{module}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf() | ({"quantization_config": quant.to_hf()} if quant is not None else {})
    (root / "config.json").write_text(json.dumps(hf, indent=2))
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
