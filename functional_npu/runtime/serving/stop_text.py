"""Stop strings, as OpenAI's ``stop``: a completion's text ends right before the first of its stop strings, which the
text never contains.

The generated tokens are turned into text as they arrive, incrementally (each token's text is what decoding the tokens
since a recent offset adds; a token that leaves an incomplete character, ``U+FFFD`` at the end, adds nothing until the
next completes it), so a character split across tokens is never cut. After each token the text is searched for the
stop strings from where a match could start; the first match ends the completion there: its text is cut before the
match, its tokens are those up to the one that completed it (the engine's request is then aborted by whoever holds
it). Until then the last ``len(longest stop string) - 1`` characters are held back, since they may begin a stop
string the next tokens complete: streamed text never shows a stop string, nor the start of one that then matches.
A completion that ends otherwise (a stop id, its length) releases what was held back with :meth:`StopText.finish`.

Everything here is pure over the tokenizer's ``decode``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StopText", "check_stop_strings", "MAX_STOP_STRINGS"]

MAX_STOP_STRINGS = 4  # OpenAI's limit for ``stop``


def check_stop_strings(value: Any, has_tokenizer: bool) -> tuple[str, ...]:
    """A request's ``stop`` (None, a string, or a list of up to :data:`MAX_STOP_STRINGS` strings) as a tuple of
    strings (empty: none).

    Raises:
        ValueError naming ``stop``: another type, an empty string, more than :data:`MAX_STOP_STRINGS`, or stop strings
            where the checkpoint has no tokenizer (nothing to turn tokens into text with).
    """
    if value is None or value == []:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop: give a string or a list of up to {MAX_STOP_STRINGS} strings, got {value!r}")
    if len(stops) > MAX_STOP_STRINGS or any(s == "" for s in stops):
        raise ValueError(
            f"stop: give up to {MAX_STOP_STRINGS} non-empty strings, got {len(stops)}"
            + (" with an empty one" if "" in stops else "")
        )
    if not has_tokenizer:
        raise ValueError(
            "stop: this checkpoint has no tokenizer to turn tokens into text, so no stop string can match; give stop "
            "token ids as stop_token_ids"
        )
    return tuple(dict.fromkeys(stops))


@dataclass
class StopText:
    """One completion's text as its tokens arrive (see the module docstring). ``decode``: the tokenizer's ``ids ->
    text``; ``stops``: the stop strings (at least one)."""

    decode: Callable[[Sequence[int]], str]
    stops: tuple[str, ...]
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # every character decoded so far
    sent: int = 0  # characters of ``text`` released
    matched: bool = False
    _prefix: int = 0  # the tokens from ``_prefix`` decode to text ending where ``_read``'s did
    _read: int = 0

    def __post_init__(self) -> None:
        if not self.stops or not all(isinstance(s, str) and s for s in self.stops):
            raise ValueError(f"StopText: stops must be non-empty strings, at least one, got {self.stops!r}")
        self._hold = max(map(len, self.stops)) - 1

    def feed(self, tokens: Sequence[int]) -> tuple[str, int | None]:
        """Take the next ``tokens``: (the text released now, and where a stop string matched the number of the
        given ``tokens`` kept, those up to the one that completed it; None while none has). Nothing is taken after
        a match."""
        released = ""
        for n, token in enumerate(tokens, 1):
            if self.matched:
                raise ValueError("StopText: a stop string has matched; the completion takes no more tokens")
            self.tokens.append(token)
            start = max(self.sent, len(self.text) - self._hold)
            self.text += self._delta()
            cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                self.matched = True
                released += self.text[self.sent : cut]
                self.text, self.sent = self.text[:cut], cut
                return released, n
            safe = max(self.sent, len(self.text) - self._hold)
            released += self.text[self.sent : safe]
            self.sent = safe
        return released, None

    def finish(self) -> str:
        """The text held back, released when the completion ends without a match."""
        rest, self.sent = self.text[self.sent :], len(self.text)
        return rest

    def _delta(self) -> str:
        """The text the last token adds (incremental detokenization: decoding from a recent offset, so a token whose
        text depends on its neighbours, a space or a character split over bytes, comes out right)."""
        before = self.decode(self.tokens[self._prefix : self._read])
        after = self.decode(self.tokens[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the tokens that complete it
        self._prefix, self._read = self._read, len(self.tokens)
        return after[len(before) :]
