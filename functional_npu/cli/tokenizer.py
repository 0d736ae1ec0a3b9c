"""A checkpoint's tokenizer (its ``tokenizer.json``, read with the ``tokenizers`` package), or the reason there is
none: a missing or broken file is a reason, not a crash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["read_tokenizer"]


def read_tokenizer(model: Path) -> tuple[Any | None, str]:
    """(the model's tokenizer or None, why it is None)."""
    file = Path(model) / "tokenizer.json"
    if not file.is_file():
        return None, f"{file} does not exist"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None, "the 'tokenizers' package is not installed"
    try:
        return Tokenizer.from_file(str(file)), ""
    except Exception as e:  # tokenizers raises its own exception type for a malformed file
        return None, f"{file} cannot be read ({' '.join(str(e).split())[:120]})"
