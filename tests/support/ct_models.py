"""Quantized checkpoints written by compressed-tensors (what llm-compressor writes and vLLM reads) from tiny
random transformers models, and their float references dequantized by compressed-tensors' own code.

The quantized tensors come from compressed-tensors' compressors (``pack-quantized``, ``int-quantized``) and the
config from its ``ModelCompressor.update_config``, so packing, names and config are theirs. Every 2-D linear
``*.weight`` of the saved float checkpoint is quantized except those ``ignore`` matches (``lm_head`` and the MoE
router), as llm-compressor's ``targets=["Linear"]`` does; the MoE experts are per-expert tensors on disk, so
they are quantized too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

SCHEMES = {
    # name: (weight args, input activation args or None, format or None for compressed-tensors' choice)
    "w8a8": (dict(num_bits=8, strategy="channel"), dict(num_bits=8, strategy="token", dynamic=True), None),
    "w8a16": (dict(num_bits=8, strategy="channel"), None, None),  # pack-quantized: four int8 to an int32
    "w4a16": (dict(num_bits=4, strategy="group", group_size=32), None, None),
    "w4a16_asym": (dict(num_bits=4, strategy="group", group_size=32, symmetric=False), None, None),
}
IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$"]


def weight_qparams(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """A min/max observer over the weight ``[out, in]`` per ``args.strategy`` (channel, group, tensor or block),
    then compressed-tensors' scale and zero point."""
    from compressed_tensors.quantization.utils import calculate_qparams

    x = w.float()
    if args.strategy == "channel":
        mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    elif args.strategy == "group":
        g = x.unflatten(-1, (-1, args.group_size))
        mn, mx = g.amin(-1), g.amax(-1)
    elif args.strategy == "tensor":
        mn, mx = x.amin().reshape(1), x.amax().reshape(1)
    else:
        rows, cols = args.block_structure
        b = x.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))
        mn, mx = b.amin(dim=(1, 3)), b.amax(dim=(1, 3))
    return calculate_qparams(mn, mx, args)


def _is_linear(name: str, t: torch.Tensor) -> bool:
    module, _, kind = name.rpartition(".")
    return kind == "weight" and t.ndim == 2 and "embed_tokens" not in module and not module.endswith("norm")


def quantize_checkpoint(src: str | Path, dst: str | Path, scheme: str, ignore=IGNORE) -> Path:
    """Write ``src`` (a float HF directory) quantized with ``scheme`` (a key of :data:`SCHEMES`) to ``dst``."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.utils import match_name
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    wargs, aargs, fmt = SCHEMES[scheme]
    qs = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**wargs),
        input_activations=QuantizationArgs(**aargs) if aargs else None,
    )
    qs.format = fmt or infer_module_format(torch.nn.Linear, qs).value
    compressor = BaseCompressor.get_value_from_registry(qs.format)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state |= load_file(f)
    out = {}
    for name, t in state.items():
        module = name.rpartition(".")[0]
        if not _is_linear(name, t) or any(match_name(module, i) for i in ignore):
            out[name] = t
            continue
        scale, zero = weight_qparams(t, qs.weights)
        local = {"weight": t, "weight_scale": scale.to(t.dtype), "weight_zero_point": zero}
        out |= {f"{module}.{k}": v.contiguous() for k, v in compressor.compress(local, qs).items()}
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    config = QuantizationConfig(
        config_groups={"group_0": qs}, ignore=list(ignore), format=qs.format, quantization_status="compressed"
    )
    ModelCompressor(quantization_config=config).update_config(str(dst))
    return dst


def dequantized_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """``src`` (a compressed-tensors checkpoint) as a float HF directory, every weight decompressed by
    compressed-tensors' own compressor: the reference transformers runs."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    hf = json.loads((src / "config.json").read_text())
    qc = QuantizationConfig.model_validate(hf.pop("quantization_config"))
    (scheme,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state |= load_file(f)
    modules = {k.rpartition(".")[0] for k in state if k.endswith(".weight_scale")}
    out = {k: v for k, v in state.items() if k.rpartition(".")[0] not in modules}
    for module in modules:
        local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == module}
        out[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"].to(local["weight_scale"].dtype)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(hf, indent=2))
    for f in src.iterdir():
        if f.suffix not in (".safetensors", ".json") or f.name == "generation_config.json":
            shutil.copy(f, dst / f.name)
    return dst
