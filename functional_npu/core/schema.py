"""Config schemas as data: each field's JSON key, type, bounds, default and what it means, the rules that tie
fields together, and one reader that checks a parsed JSON object against them.

A family declares its ``config.json`` fields next to its config (:class:`Field` and :class:`Rule` values) and
reads them with :func:`read`, which refuses anything malformed (a missing key, a null, a wrong type, a value
out of range or not supported, fields that contradict each other) in one line naming the file, the field,
the value and a fix, before any tensor is read or any rank starts::

    config.json: field 'kv_lora_rank' is missing (a DeepseekV3ForCausalLM config needs it: the rank of the
    compressed KV); add it

Types are strict, as JSON writes them: an int field takes an int (not ``4.0``, not ``"4"``: the message says
what to write instead), a float field an int or a finite float, a bool field ``true`` or ``false``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["REQUIRED", "Field", "Rule", "read", "check_rules", "show"]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # a field's default when it must be given; its ``null`` when null is refused

_KINDS = {
    "int": "an int",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "dict": "a JSON object",
    "list": "a JSON list",
    "int_list": "a list of ints",
    "str_list": "a list of strings",
}


@dataclass(frozen=True, slots=True)
class Field:
    """One key of a JSON config object.

    Attributes:
        key: the JSON key.
        kind: ``"int"``, ``"float"``, ``"bool"``, ``"str"``, ``"dict"``, ``"list"``, ``"int_list"`` or ``"str_list"``.
        what: what the value is, in a few words (the error messages say it).
        default: the value when the key is absent; ``REQUIRED``: it must be given.
        null: the value when the key is null; ``REQUIRED``: null is refused.
        low: the least value allowed (inclusive); ``gt``: a bound the value must exceed.
        choices: the values supported (none: any of the kind).
    """

    key: str
    kind: str
    what: str
    default: Any = REQUIRED
    null: Any = REQUIRED
    low: float | None = None
    gt: float | None = None
    choices: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class Rule:
    """A condition over fields already read: ``holds(values)``, else the error ``says`` (a format string over
    the values by key) names ``keys``. ``when`` limits the rule to the configs it applies to."""

    keys: tuple[str, ...]
    holds: Callable[[Mapping[str, Any]], bool]
    says: str
    when: Callable[[Mapping[str, Any]], bool] = lambda v: True


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)`` on one line, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read(
    obj: Any,
    fields: Sequence[Field],
    rules: Sequence[Rule] = (),
    *,
    where: str = "config.json",
    needs: str = "this config",
    prefix: str = "",
) -> dict[str, Any]:
    """The values of ``fields`` in ``obj`` (a parsed JSON object), by key, checked against ``fields`` and ``rules``.

    Args:
        where: the file (or object) named first in every message.
        needs: who needs a missing field (``"a DeepseekV3ForCausalLM config"``).
        prefix: the path of ``obj`` inside the file (``"rope_scaling."``), named before each key.

    Raises:
        ValueError in one line naming ``where``, the field, the value and a fix.
    """
    if not isinstance(obj, Mapping):
        name = f"field '{prefix[:-1]}'" if prefix else "the config"
        raise ValueError(f'{where}: {name} must be a JSON object, got {show(obj)}; write it as {{"key": value, ...}}')
    values = {f.key: _value(obj, f, where, needs, prefix) for f in fields}
    check_rules(values, rules, where=where, prefix=prefix)
    return values


def check_rules(values: Mapping[str, Any], rules: Sequence[Rule], *, where: str, prefix: str = "") -> None:
    """Raise the first of ``rules`` that ``values`` break, in one line naming its fields."""
    for rule in rules:
        if rule.when(values) and not rule.holds(values):
            keys = ", ".join(f"'{prefix}{k}'" for k in rule.keys)
            raise ValueError(f"{where}: fields {keys}: {rule.says.format(**values)}")


def _value(obj: Mapping[str, Any], f: Field, where: str, needs: str, prefix: str) -> Any:
    name = f"field '{prefix}{f.key}'"
    if f.key not in obj:
        if f.default is REQUIRED:
            raise ValueError(f"{where}: {name} is missing ({needs} needs it: {f.what}); add it")
        return f.default
    v = obj[f.key]
    if v is None:
        if f.null is REQUIRED:
            fix = f"give {_KINDS[f.kind]}" + ("" if f.default is REQUIRED else f" or remove it (default {f.default!r})")
            raise ValueError(f"{where}: {name} is null ({f.what}); {fix}")
        return f.null
    if not _is_kind(v, f.kind):
        raise ValueError(f"{where}: {name} must be {_KINDS[f.kind]} ({f.what}), got {show(v)}{_hint(v, f.kind)}")
    if f.choices and v not in f.choices:
        raise ValueError(
            f"{where}: {prefix}{f.key} {show(v)} is not supported; supported: {', '.join(map(str, f.choices))} "
            f"({f.what})"
        )
    if f.low is not None and v < f.low:
        raise ValueError(f"{where}: {name} must be at least {f.low} ({f.what}), got {show(v)}")
    if f.gt is not None and not v > f.gt:
        raise ValueError(f"{where}: {name} must be greater than {f.gt} ({f.what}), got {show(v)}")
    return list(v) if f.kind.endswith("list") else v


def _is_kind(v: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if kind in ("bool", "str", "dict", "list"):
        return isinstance(v, {"bool": bool, "str": str, "dict": Mapping, "list": list}[kind])
    return isinstance(v, list) and all(_is_kind(x, kind.removesuffix("_list")) for x in v)


def _hint(v: Any, kind: str) -> str:
    """What to write instead of ``v``, where that is plain."""
    if kind == "int" and isinstance(v, float) and v.is_integer():
        return f"; write {int(v)} (ints are read strictly)"
    if kind in ("int", "float") and isinstance(v, str):
        try:
            float(v)
            return f"; write {v} without quotes"
        except ValueError:
            return ""
    if kind == "bool" and isinstance(v, str) and v.lower() in ("true", "false"):
        return f"; write {v.lower()} without quotes"
    if kind.endswith("list") and isinstance(v, (str, int, float)) and not isinstance(v, bool):
        return f"; write it as a list: [{v!r}]".replace("'", '"')
    return ""
