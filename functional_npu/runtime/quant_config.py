"""A checkpoint's quantization, read from ``config.json``'s ``quantization_config`` (compressed-tensors).

What llm-compressor writes and vLLM reads: ``quant_method: "compressed-tensors"``, one or more
``config_groups`` each with ``targets``, ``weights`` and ``input_activations`` arguments and a
``format``, and an ``ignore`` list. :func:`read_quant_config` turns the supported part into a
:class:`QuantConfig` (one :class:`functional_npu.core.quant.Quant` and the modules it applies to)
and refuses everything else in one line that names the setting and what is supported, before any
tensor is read: fp8 and other float formats, activation reordering, static or non-token activation
scales, output or KV-cache quantization, sparsity and transforms, several schemes in one model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.quant import Quant
from ..core.tree import register_static

__all__ = ["QuantConfig", "read_quant_config"]

FORMATS = {"int-quantized": False, "naive-quantized": False, "pack-quantized": True}  # format -> packed
SUPPORTED = (
    "compressed-tensors int-quantized / naive-quantized (int8) and pack-quantized (int4, int8) weights with "
    "tensor, channel, group or block scales, optionally with dynamic per-token int8 activations"
)


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """The checkpoint's scheme, and which linear modules it covers (``targets`` minus ``ignore``, matched as
    compressed-tensors matches: a class name, an exact module name, or ``re:`` + a regex anchored at the start)."""

    quant: Quant
    format: str
    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    @staticmethod
    def of(quant: Quant, ignore: tuple[str, ...] = ("lm_head",)) -> QuantConfig:
        """The config compressed-tensors writes for ``quant`` over every linear module except ``ignore``."""
        fmt = "pack-quantized" if quant.packed else "int-quantized" if quant.activations else "naive-quantized"
        return QuantConfig(quant, fmt, ("Linear",), tuple(ignore))

    def to_hf(self) -> dict[str, Any]:
        """The ``quantization_config`` dict of ``config.json`` (read back by :func:`read_quant_config`, and by
        compressed-tensors, transformers and vLLM)."""
        q = self.quant
        weights: dict[str, Any] = {
            "num_bits": q.bits,
            "type": "int",
            "symmetric": q.symmetric,
            "strategy": q.strategy,
            "group_size": q.group_size,
            "dynamic": False,
            "actorder": None,
        }
        if q.block:
            weights["block_structure"] = list(q.block)
        acts = None
        if q.activations:
            acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
        group = {
            "targets": list(self.targets),
            "weights": weights,
            "input_activations": acts,
            "output_activations": None,
            "format": self.format,
        }
        return {
            "quant_method": "compressed-tensors",
            "format": self.format,
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": list(self.ignore),
            "kv_cache_scheme": None,
            "sparsity_config": {},
            "transform_config": {},
        }

    def applies_to(self, module: str, kind: str = "Linear") -> bool:
        """Whether ``module`` (a checkpoint module name, e.g. ``model.layers.0.mlp.gate_proj``) of class
        ``kind`` is quantized."""
        return any(_match(module, kind, t) for t in self.targets) and not any(
            _match(module, kind, i) for i in self.ignore
        )


# the config rides in the params as a node with no leaves, like the model config
register_static(QuantConfig)


def _match(module: str, kind: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern in (module, kind)


def _refuse(what: str) -> ValueError:
    return ValueError(f"quantization_config: {what} is not supported; supported: {SUPPORTED}")


def read_quant_config(hf: Mapping[str, Any]) -> QuantConfig | None:
    """The quantization of a checkpoint from its ``config.json`` dict (None when it has none)."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"quantization_config must be a JSON object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise _refuse(f"quant_method {method!r}")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise _refuse(f"{key} {dict(qc[key])}")
    if qc.get("kv_cache_scheme"):
        raise _refuse("kv_cache_scheme (a quantized KV cache)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(f"{len(groups)} config_groups ({', '.join(groups) or 'none'}; one scheme per model)")
    ((name, group),) = groups.items()
    fmt = group.get("format") or qc.get("format")
    if fmt not in FORMATS:
        raise _refuse(f"config_groups.{name}.format {fmt!r}")
    if group.get("output_activations"):
        raise _refuse(f"config_groups.{name}.output_activations")
    quant = Quant(
        **_weights(name, group.get("weights") or {}),
        activations=_activations(name, group.get("input_activations")),
        packed=FORMATS[fmt],
    )
    targets = tuple(group.get("targets") or ())
    if not targets:
        raise _refuse(f"config_groups.{name} with no targets")
    return QuantConfig(quant, fmt, targets, tuple(qc.get("ignore") or ()))


def _weights(name: str, w: Mapping[str, Any]) -> dict[str, Any]:
    where = f"config_groups.{name}.weights"
    if w.get("type", "int") != "int":
        raise _refuse(f"{where}.type {w.get('type')!r} (float weights such as fp8 have no CPU kernel here)")
    bits = w.get("num_bits")
    if bits not in (4, 8):
        raise _refuse(f"{where}.num_bits {bits!r}")
    if w.get("actorder") not in (None, False):
        raise _refuse(f"{where}.actorder {w.get('actorder')!r} (activation reordering)")
    if w.get("dynamic"):
        raise _refuse(f"{where}.dynamic true (weights are quantized once, in the file)")
    strategy = w.get("strategy", "tensor")
    if strategy not in ("tensor", "channel", "group", "block"):
        raise _refuse(f"{where}.strategy {strategy!r}")
    out: dict[str, Any] = {"bits": bits, "strategy": strategy, "symmetric": bool(w.get("symmetric", True))}
    if strategy == "group":
        out["group_size"] = w.get("group_size")
    if strategy == "block":
        block = w.get("block_structure")
        out["block"] = tuple(block) if isinstance(block, (list, tuple)) else block
    try:
        Quant(**out)
    except ValueError as e:
        raise _refuse(f"{where} {dict(w)} ({e})") from None
    return out


def _activations(name: str, a: Mapping[str, Any] | None) -> str | None:
    if not a:
        return None
    where = f"config_groups.{name}.input_activations"
    dynamic, strategy, bits = a.get("dynamic"), a.get("strategy"), a.get("num_bits")
    if a.get("type", "int") != "int" or bits != 8 or strategy != "token" or dynamic is not True:
        raise _refuse(
            f"{where} (num_bits {bits}, type {a.get('type')!r}, strategy {strategy!r}, dynamic {dynamic}): only "
            f"dynamic per-token int8"
        )
    if a.get("symmetric") is False:
        raise _refuse(f"{where} asymmetric activations")
    return "token"
