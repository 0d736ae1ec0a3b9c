"""The rotary-embedding parameters of a ``config.json`` as a schema (:mod:`functional_npu.core.schema`), by rope
type: what each type needs, as transformers' rope validation asks for it, with the defaults it fills in.

A config gives them as ``rope_parameters`` (transformers 5) or ``rope_scaling`` beside a top-level
``rope_theta`` (older files); the type is ``rope_type`` (or the older ``type``). :func:`read_rope` reads either
form and refuses a malformed one in one line naming the field (``rope_scaling.factor``) and a fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..core.schema import Field, Rule, read

__all__ = ["ROPE_FIELDS", "ROPE_RULES", "rope_source", "read_rope"]

_FACTOR = Field("factor", "float", "the context scaling factor", gt=0)
# rope type -> its fields beyond rope_type and rope_theta ({max_positions}: the config's max_position_embeddings)
ROPE_FIELDS: dict[str, tuple[Field, ...]] = {
    "default": (),
    "linear": (_FACTOR,),
    "llama3": (
        _FACTOR,
        Field("low_freq_factor", "float", "llama3's low-frequency factor", default=1.0, gt=0),
        Field("high_freq_factor", "float", "llama3's high-frequency factor", default=4.0, gt=0),
        Field("original_max_position_embeddings", "int", "the context length before scaling", low=1),
    ),
    "yarn": (
        _FACTOR,
        Field("original_max_position_embeddings", "int", "the context length before scaling", low=1),
        Field("beta_fast", "float", "yarn's fast boundary", default=32.0, null=32.0),
        Field("beta_slow", "float", "yarn's slow boundary", default=1.0, null=1.0),
        Field("mscale", "float", "yarn's attention scale", default=0.0, null=0.0, low=0),
        Field("mscale_all_dim", "float", "yarn's attention scale over all dims", default=0.0, null=0.0, low=0),
        Field("attention_factor", "float", "yarn's attention factor", default=None, null=None, gt=0),
        Field("truncate", "bool", "whether yarn truncates its correction range", default=True, null=True),
    ),
}
ROPE_RULES: dict[str, tuple[Rule, ...]] = {
    "llama3": (
        Rule(
            ("low_freq_factor", "high_freq_factor"),
            lambda v: v["high_freq_factor"] > v["low_freq_factor"],
            "high_freq_factor {high_freq_factor} must exceed low_freq_factor {low_freq_factor} (llama3 rope divides "
            "by their difference); use Llama 3's 1.0 and 4.0",
        ),
    ),
    "yarn": (
        Rule(
            ("beta_fast", "beta_slow"),
            lambda v: v["beta_fast"] > v["beta_slow"],
            "beta_fast {beta_fast} must exceed beta_slow {beta_slow}; use yarn's 32 and 1",
        ),
    ),
}


def rope_source(hf: Mapping[str, Any]) -> tuple[str, Any]:
    """``(key, value)`` of the config's rope parameters: ``rope_parameters``, else ``rope_scaling`` (``{}``: none)."""
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None:
            return key, hf[key]
    return "rope_parameters", {}


def read_rope(
    rope: Any, types: Sequence[str], *, theta: float, max_positions: int, where: str = "config.json", path: str = ""
) -> dict[str, Any]:
    """The rope parameters ``rope`` (a parsed JSON object found at ``path``; by default the config's, ``rope`` the
    whole config) hold, checked for a type of ``types``: ``rope_type``, ``rope_theta`` (default ``theta``) and the
    type's fields by key (``original_max_position_embeddings`` defaults to ``max_positions``)."""
    if not path:
        path, rope = rope_source(rope)
    prefix = f"{path}."
    read(rope, (), where=where, prefix=prefix)  # a JSON object
    kind = "type" if "rope_type" not in rope and "type" in rope else "rope_type"
    head = (
        Field(kind, "str", "the rope type", default="default", choices=tuple(types)),
        Field("rope_theta", "float", "the rotary base", default=theta, gt=0),
    )
    out = read(rope, head, where=where, prefix=prefix)
    rope_type = out.pop(kind)
    fields = tuple(
        replace(f, default=max_positions) if f.key == "original_max_position_embeddings" else f
        for f in ROPE_FIELDS[rope_type]
    )
    needs = f"rope_type {rope_type!r}"
    return (
        out
        | read(rope, fields, ROPE_RULES.get(rope_type, ()), where=where, needs=needs, prefix=prefix)
        | {"rope_type": rope_type}
    )
