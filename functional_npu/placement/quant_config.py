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
from ..core.schema import Field, read, show
from ..core.tree import register_static

__all__ = ["QuantConfig", "PRESETS", "read_quant_config"]

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

    def __post_init__(self) -> None:
        if not isinstance(self.quant, Quant):
            raise TypeError(
                f"QuantConfig: quant must be a Quant (e.g. Quant(8) or Quant(4, 'group', 128)), got {self.quant!r}"
            )
        if self.format not in FORMATS:
            raise ValueError(f"QuantConfig: format must be one of {list(FORMATS)}, got {self.format!r}")
        for name in ("targets", "ignore"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(t, str) for t in value):
                fix = f"({value!r},)" if isinstance(value, str) else "('Linear',)"
                raise TypeError(
                    f"QuantConfig: {name} must be a tuple of module names or classes (a str is read letter by "
                    f"letter), got {value!r}; give {fix}"
                )

    @staticmethod
    def of(quant: Quant, ignore: tuple[str, ...] = ("lm_head",)) -> QuantConfig:
        """The config compressed-tensors writes for ``quant`` over every linear module except ``ignore``."""
        if not isinstance(quant, Quant):
            raise TypeError(
                f"QuantConfig.of: quant must be a Quant (e.g. Quant(8) or Quant(4, 'group', 128)), got {quant!r}"
            )
        if isinstance(ignore, str):
            raise TypeError(
                f"QuantConfig.of: ignore must be a tuple of module names, got {ignore!r}; give ({ignore!r},)"
            )
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


# ---- config.json's quantization_config, as a schema (functional_npu.core.schema) -----------------------------
_TOP = (
    Field("quant_method", "str", "the quantization method"),
    Field("format", "str", "how every group's weights are stored", default=None, null=None),
    Field("config_groups", "dict", "the schemes, by group name", default={}, null={}),
    Field("ignore", "str_list", "the modules left unquantized", default=[], null=[]),
    Field("sparsity_config", "dict", "the sparsity", default=None, null=None),
    Field("transform_config", "dict", "the transforms", default=None, null=None),
    Field("kv_cache_scheme", "dict", "the KV cache's quantization", default=None, null=None),
)
_GROUP = (
    Field("targets", "str_list", "the modules the scheme covers"),
    Field("weights", "dict", "the weights' quantization"),
    Field("input_activations", "dict", "the activations' quantization", default=None, null=None),
    Field("output_activations", "dict", "the outputs' quantization", default=None, null=None),
    Field("format", "str", "how the weights are stored", default=None, null=None),
)
_WEIGHTS = (
    Field("num_bits", "int", "bits per weight"),
    Field("type", "str", "int or float", default="int", null="int"),
    Field("symmetric", "bool", "no zero points", default=True, null=True),
    Field("strategy", "str", "what one scale covers", default=None, null=None),
    Field("group_size", "int", "values per scale, for strategy group", default=None, null=None),
    Field("block_structure", "int_list", "rows and columns per scale, for strategy block", default=None, null=None),
    Field("dynamic", "bool", "scales computed at run time", default=False, null=False),
)
_ACTIVATIONS = (
    Field("num_bits", "int", "bits per activation"),
    Field("type", "str", "int or float", default="int", null="int"),
    Field("symmetric", "bool", "no zero points", default=True, null=True),
    Field("strategy", "str", "what one scale covers", default=None, null=None),
    Field("dynamic", "bool", "scales computed at run time", default=False, null=False),
)
# compressed-tensors' preset schemes (``config_groups: {"W4A16": ["Linear"]}``, its PRESET_SCHEMES) that are
# schemes supported here; the others (fp8, fp4, 2-, 3-, 5- to 7-bit, int4 activations) are refused by name
_GROUP_128 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128, "dynamic": False}
_CHANNEL_8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
_TOKEN_8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
PRESETS: dict[str, dict[str, Any]] = {
    "W8A16": {"weights": _GROUP_128 | {"num_bits": 8}},
    "W4A16": {"weights": _GROUP_128},
    "W4A16_ASYM": {"weights": _GROUP_128 | {"symmetric": False}},
    "W4A8": {"weights": _GROUP_128, "input_activations": _TOKEN_8},
    "W8A8": {"weights": _CHANNEL_8, "input_activations": _TOKEN_8},
    "INT8": {"weights": _CHANNEL_8, "input_activations": _TOKEN_8},
}


def _refuse(what: str, where: str = "config.json") -> ValueError:
    return ValueError(f"{where}: quantization_config: {what} is not supported; supported: {SUPPORTED}")


def read_quant_config(hf: Mapping[str, Any], where: str = "config.json") -> QuantConfig | None:
    """The quantization of a checkpoint from its ``config.json`` dict (None when it has none), checked against
    the schema above; one line naming ``where`` and the field for anything malformed or unsupported."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    top = "quantization_config."
    read(qc, (), where=where, prefix=top)  # a JSON object
    needs = "a compressed-tensors quantization_config"
    if qc.get("quant_method") != "compressed-tensors":
        raise _refuse(f"quant_method {show(qc.get('quant_method'))}", where)
    v = read(qc, _TOP, where=where, needs=needs, prefix=top)
    for key in ("sparsity_config", "transform_config"):
        if v[key]:
            raise _refuse(f"{key} {show(dict(v[key]))}", where)
    if v["kv_cache_scheme"]:
        raise _refuse("kv_cache_scheme (a quantized KV cache)", where)
    groups = v["config_groups"]
    if len(groups) != 1:
        raise _refuse(f"{len(groups)} config_groups ({', '.join(groups) or 'none'}; one scheme per model)", where)
    ((name, group),) = groups.items()
    prefix = f"{top}config_groups.{name}."
    scheme = _scheme(name, group, where, prefix)
    g = read(scheme, _GROUP, where=where, needs="a compressed-tensors scheme", prefix=prefix)
    fmt = g["format"] or v["format"]
    if fmt is None:
        raise ValueError(
            f"{where}: {prefix}format and {top}format are both missing (how the weights are stored); set one to "
            f"{', '.join(FORMATS)}"
        )
    if fmt not in FORMATS:
        raise _refuse(f"config_groups.{name}.format {fmt!r}", where)
    if g["output_activations"]:
        raise _refuse(f"config_groups.{name}.output_activations", where)
    if not g["targets"]:
        raise _refuse(f"config_groups.{name} with no targets", where)
    weights = _weights(g["weights"], where, prefix + "weights.")
    activations = _activations(g["input_activations"], where, prefix + "input_activations.")
    try:
        quant = Quant(**weights, activations=activations, packed=FORMATS[fmt])
    except ValueError as e:
        raise _refuse(f"config_groups.{name}.format {fmt!r} for {weights['bits']}-bit weights ({e})", where) from None
    return QuantConfig(quant, fmt, tuple(g["targets"]), tuple(v["ignore"]))


def _scheme(name: str, group: Any, where: str, prefix: str) -> Any:
    """A group's scheme: as given, or (a list of targets) compressed-tensors' preset ``name`` for them."""
    if not isinstance(group, list):
        if not isinstance(group, Mapping):
            raise ValueError(
                f"{where}: field '{prefix[:-1]}' must be a scheme (a JSON object with targets and weights) or a list "
                f"of targets for a preset scheme, got {show(group)}"
            )
        return group
    preset = PRESETS.get(name.upper())
    if preset is None:
        raise ValueError(
            f"{where}: {prefix[:-1]} is a list of targets, which compressed-tensors reads as preset scheme "
            f"{name!r}; that preset is not supported here; supported presets: {', '.join(PRESETS)} (or write the "
            f"scheme out: targets, weights, input_activations)"
        )
    return {"targets": group, **preset}


def _weights(w: Mapping[str, Any], where: str, prefix: str) -> dict[str, Any]:
    v = read(w, _WEIGHTS, where=where, needs="a scheme's weights", prefix=prefix)
    name = prefix[len("quantization_config.") : -1]
    if v["type"] != "int":
        raise _refuse(f"{name}.type {v['type']!r} (float weights such as fp8 have no CPU kernel here)", where)
    bits = v["num_bits"]
    if bits not in (4, 8):
        raise _refuse(f"{name}.num_bits {bits!r}", where)
    if w.get("actorder") not in (None, False):
        raise _refuse(f"{name}.actorder {show(w.get('actorder'))} (activation reordering)", where)
    if v["dynamic"]:
        raise _refuse(f"{name}.dynamic true (weights are quantized once, in the file)", where)
    group_size, strategy = v["group_size"], v["strategy"]
    if strategy is None:  # as compressed-tensors infers it
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    if strategy == "channel" and group_size == -1:
        group_size = None
    if strategy not in ("tensor", "channel", "group", "block"):
        raise _refuse(f"{name}.strategy {strategy!r}", where)
    out: dict[str, Any] = {"bits": bits, "strategy": strategy, "symmetric": v["symmetric"]}
    needs = {"group": ("group_size", group_size), "block": ("block_structure", v["block_structure"])}.get(strategy)
    if needs and needs[1] is None:
        raise ValueError(
            f"{where}: field '{prefix}{needs[0]}' is missing (strategy {strategy!r} needs it: what one scale covers); "
            f"add it"
        )
    if strategy == "group" or group_size is not None:
        out["group_size"] = group_size
    if strategy == "block" or v["block_structure"] is not None:
        block = v["block_structure"]
        out["block"] = tuple(block) if block is not None else None
    try:
        Quant(**out)
    except ValueError as e:
        given = f"num_bits {bits}, strategy {strategy!r}, group_size {group_size}, block_structure "
        given += f"{v['block_structure']}, symmetric {v['symmetric']}"
        raise _refuse(f"{name} ({given}: {e})", where) from None
    return out


def _activations(a: Mapping[str, Any] | None, where: str, prefix: str) -> str | None:
    if not a:
        return None
    v = read(a, _ACTIVATIONS, where=where, needs="a scheme's input_activations", prefix=prefix)
    name = prefix[len("quantization_config.") : -1]
    dynamic, strategy, bits = v["dynamic"], v["strategy"], v["num_bits"]
    if v["type"] != "int" or bits != 8 or strategy != "token" or dynamic is not True:
        raise _refuse(
            f"{name} (num_bits {bits}, type {v['type']!r}, strategy {strategy!r}, dynamic {dynamic}): only "
            f"dynamic per-token int8",
            where,
        )
    if not v["symmetric"]:
        raise _refuse(f"{name} asymmetric activations", where)
    return "token"
