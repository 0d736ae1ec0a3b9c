"""Stop strings (:mod:`functional_npu.runtime.serving.stop_text`) over a byte-level BPE tokenizer of the ``tokenizers``
package, trained here on text with characters of one to four bytes, so that tokens split characters. The reference is
counted apart from the incremental matcher: the whole text decoded at once and ``str.find``, and the fewest tokens
whose decoded text holds the stop string."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu.runtime.serving.stop_text import MAX_STOP_STRINGS, StopText, check_stop_strings

ALPHABET = "ab c\né日😀ü🙂"  # one to four bytes in UTF-8; ü and 🙂 are not in the training text: split over tokens


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["ab c日 abab 😀a é日é\n" * 4, "cab ba 日本 😀😀 éa"], trainer)
    return tok


def _feed(text: StopText, tokens: list[int], chunk: int) -> tuple[list[str], int | None]:
    """Feed ``tokens`` ``chunk`` at a time: (the released pieces, the tokens kept: all fed before the match's chunk
    plus the match's own count; None without a match)."""
    pieces, fed = [], 0
    for i in range(0, len(tokens), chunk):
        released, kept = text.feed(tokens[i : i + chunk])
        pieces.append(released)
        if kept is not None:
            return pieces, fed + kept
        fed += len(tokens[i : i + chunk])
    return pieces, None


@settings(max_examples=150, deadline=None)
@given(data=st.data(), chunk=st.integers(1, 4))
def test_the_text_ends_before_the_first_stop_string_and_never_shows_it(tokenizer, data, chunk):
    body = data.draw(st.text(ALPHABET, min_size=1, max_size=30))
    i = data.draw(st.integers(0, len(body) - 1))
    stop = body[i : data.draw(st.integers(i + 1, min(len(body), i + 4)))]
    tokens = tokenizer.encode(body).ids
    assert tokenizer.decode(tokens) == body  # byte-level: the whole text decodes back
    want = [n for n in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:n])][0]
    text = StopText(tokenizer.decode, (stop,))
    pieces, kept = _feed(text, tokens, chunk)
    assert kept == want and text.matched
    assert "".join(pieces) == text.text == body[: body.find(stop)]
    assert all(stop not in "".join(pieces[: j + 1]) for j in range(len(pieces)))  # nothing shown that then matched
    with pytest.raises(ValueError, match="a stop string has matched"):
        text.feed(tokens[:1])


@settings(max_examples=60, deadline=None)
@given(body=st.text(ALPHABET, min_size=1, max_size=30), chunk=st.integers(1, 4))
def test_without_a_match_the_held_back_text_is_released_at_the_end(tokenizer, body, chunk):
    tokens = tokenizer.encode(body).ids
    text = StopText(tokenizer.decode, ("zz", "qqq"))  # never in ALPHABET's text
    pieces, kept = _feed(text, tokens, chunk)
    assert kept is None and not text.matched
    rest = text.finish()
    assert len(rest) <= 2 and "".join(pieces) + rest == body == text.text  # at most len("qqq") - 1 held back


def test_of_several_stop_strings_the_first_to_complete_ends_it(tokenizer):
    tokens = tokenizer.encode("ab cab").ids
    text = StopText(tokenizer.decode, ("cab", "b c"))
    pieces, _ = _feed(text, tokens, 1)
    assert text.text == "a"  # "b c" completes before "cab"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (3, r"stop: give a string or a list of up to 4 strings, got 3"),
        (["a", 1], r"stop: give a string or a list of up to 4 strings, got \['a', 1\]"),
        (["a", "b", "c", "d", "e"], r"stop: give up to 4 non-empty strings, got 5"),
        ("", r"stop: give up to 4 non-empty strings, got 1 with an empty one"),
        (["a", ""], r"stop: give up to 4 non-empty strings, got 2 with an empty one"),
    ],
)
def test_bad_stop_strings_are_refused_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        check_stop_strings(value, True)


def test_stop_strings_need_a_tokenizer_and_repeat_once():
    assert check_stop_strings(None, False) == check_stop_strings([], False) == ()
    assert check_stop_strings("x", True) == ("x",) and check_stop_strings(["x", "y", "x"], True) == ("x", "y")
    assert MAX_STOP_STRINGS == 4
    with pytest.raises(ValueError, match=r"stop: this checkpoint has no tokenizer .* give stop token ids as "):
        check_stop_strings(["x"], False)
    with pytest.raises(ValueError, match=r"StopText: stops must be non-empty strings"):
        StopText(str, ())
