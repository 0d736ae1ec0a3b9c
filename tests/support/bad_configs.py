"""Malformed config.json files, one per case users hit: each a change to a valid tiny config (the DeepSeek-V3 or
dense Qwen3 of :mod:`tests.support.configs`) and a phrase the one-line refusal must hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from functional_npu.core.quant import Quant
from functional_npu.placement.quant_config import QuantConfig

from .configs import DENSE, MLA

_DROP = object()  # a key to leave out
_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 1024}
_INT4 = QuantConfig.of(Quant(4, "group", group_size=32)).to_hf()


def _deepseek(**change: Any) -> dict[str, Any]:
    hf = MLA.to_hf() | change
    return {k: v for k, v in hf.items() if v is not _DROP}


def _quantized(**group: Any) -> dict[str, Any]:
    qc = _INT4 | {"config_groups": group}
    return DENSE.to_hf() | {"quantization_config": qc}


# name -> (config.json, a phrase of the refusal)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "kv_lora_rank missing": (_deepseek(kv_lora_rank=_DROP), "field 'kv_lora_rank' is missing"),
    "yarn factor null": (
        _deepseek(rope_parameters=_YARN | {"factor": None}),
        "field 'rope_parameters.factor' is null",
    ),
    "yarn original_max_position_embeddings null": (
        _deepseek(rope_parameters=_YARN | {"original_max_position_embeddings": None}),
        "field 'rope_parameters.original_max_position_embeddings' is null",
    ),
    "rope_scaling a string": (
        _deepseek(rope_parameters=_DROP, rope_scaling="yarn"),
        "field 'rope_scaling' must be a JSON object, got 'yarn'",
    ),
    "num_experts_per_tok above the experts": (
        _deepseek(num_experts_per_tok=9),
        "9 experts per token is more than the model's 8 experts",
    ),
    "n_group does not divide the experts": (_deepseek(n_group=3), "3 does not divide 8"),
    "topk_group above n_group": (_deepseek(topk_group=3), "topk_group=3 groups per token is more than the n_group=2"),
    "a preset group not supported": (
        _quantized(FP8=["Linear"]),
        "preset scheme 'FP8'; that preset is not supported here; supported presets: W8A16, W4A16",
    ),
    "a group not an object": (
        _quantized(group_0=5),
        "field 'quantization_config.config_groups.group_0' must be a scheme",
    ),
    "targets a string": (
        _quantized(group_0=_INT4["config_groups"]["group_0"] | {"targets": "Linear"}),
        "field 'quantization_config.config_groups.group_0.targets' must be a list of strings",
    ),
}


def write(root: Path, name: str) -> Path:
    """A model directory holding only case ``name``'s config.json (the config is read before any weight)."""
    path = root / name.replace(" ", "_")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CASES[name][0]))
    return path
