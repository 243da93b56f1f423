"""Incremental detokenization of multi-byte text, and stop strings that arrive in pieces."""

from importlib import resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopStringMatcher

CORPUS = resources.files("engine").joinpath("assets/corpus.txt").read_text(encoding="utf-8")
# Beyond the corpus: characters the tokenizer never merged, so each is split into single-byte tokens.
UNSEEN_TEXTS = [
    "日本語のテキスト 🎉🎉 Ωμέγα ñandú 𝄞𓀀",
    "👩‍👩‍👧‍👦 family, 🇫🇷 flag, e\u0301 combining accent",
    "ÆØÅ æøå — “quotes” … € ₿ ∑ ∞",
]


def _stream(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """What the detokenizer emits after each token is appended."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    return [detokenizer.decode_new(token_ids[: n + 1]) for n in range(len(token_ids))]


def _assert_streams_exactly_the_full_decode(tokenizer, text: str) -> None:
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = _stream(tokenizer, token_ids)
    assert "".join(pieces) == tokenizer.decode(token_ids) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


@pytest.mark.parametrize("line_number", range(len(CORPUS.splitlines())))
def test_streamed_corpus_lines_concatenate_to_the_full_decode(tokenizer, line_number):
    _assert_streams_exactly_the_full_decode(tokenizer, CORPUS.splitlines()[line_number])


def test_streamed_whole_corpus_concatenates_to_the_full_decode(tokenizer):
    _assert_streams_exactly_the_full_decode(tokenizer, CORPUS)


@pytest.mark.parametrize("text", UNSEEN_TEXTS)
def test_characters_split_over_several_tokens_come_out_whole(tokenizer, text):
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in token_ids)  # the text does split characters
    _assert_streams_exactly_the_full_decode(tokenizer, text)


# Valid text (no lone surrogates) without a literal U+FFFD, which at the end is indistinguishable from an
# incomplete character, and without special-token text such as "<|eos|>", which decoding skips.
VALID_CHARACTERS = st.characters(codec="utf-8", exclude_characters=REPLACEMENT_CHAR)
ORDINARY_TEXT = st.text(VALID_CHARACTERS, min_size=1, max_size=40).filter(lambda text: "<|" not in text)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=ORDINARY_TEXT)
def test_any_text_streams_exactly_to_its_full_decode(tokenizer, text):
    _assert_streams_exactly_the_full_decode(tokenizer, text)


def test_an_incomplete_character_is_held_back_until_its_last_byte_arrives(tokenizer):
    token_ids = tokenizer.encode("🎉!", add_special_tokens=False)
    pieces = _stream(tokenizer, token_ids)
    # The emoji's four bytes come as several tokens: nothing shows until the last of them.
    assert len(token_ids) > 2
    assert pieces[:-2] == [""] * (len(token_ids) - 2)
    assert pieces[-2:] == ["🎉", "!"]


def test_text_so_far_is_always_a_prefix_of_the_final_text(tokenizer):
    text = CORPUS.splitlines()[15] + UNSEEN_TEXTS[0]
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    so_far = ""
    for piece in _stream(tokenizer, token_ids):
        so_far += piece
        assert text.startswith(so_far)
    assert so_far == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_are_skipped_or_kept_as_asked(tokenizer, skip_special_tokens):
    body = tokenizer.encode("café 世界", add_special_tokens=False)
    token_ids = [tokenizer.bos_token_id, *body, tokenizer.eos_token_id, *body]
    streamed = "".join(_stream(tokenizer, token_ids, skip_special_tokens))
    assert streamed == tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert ("<|eos|>" in streamed) is not skip_special_tokens


def _feed(matcher: StopStringMatcher, pieces: list[str]) -> tuple[int, int]:
    """Grow the text piece by piece; return (index of the piece that completed a stop string, its position)."""
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        position = matcher.find(text, len(piece))
        if position >= 0:
            return i, position
    return -1, -1


def test_a_stop_string_split_across_several_increments_is_found_when_its_last_piece_arrives():
    pieces = ["Once upon a ti", "me th", "e", "re was a town"]
    assert _feed(StopStringMatcher(("time there",)), pieces) == (3, len("Once upon a "))


def test_a_stop_string_arriving_one_character_at_a_time_is_found():
    text = "the end of the story"
    assert _feed(StopStringMatcher(("the story",)), list(text)) == (len(text) - 1, text.index("the story"))


def test_a_multi_byte_stop_string_is_found():
    pieces = ["🚀 ", "こんにち", "は世", "界"]
    assert _feed(StopStringMatcher(("は世界",)), pieces) == (3, "".join(pieces).index("は世界"))


def test_the_earliest_of_several_stop_strings_wins():
    matcher = StopStringMatcher(("world", "o w", "Hello there"))
    assert matcher.find("Hello world", len("Hello world")) == len("Hell")


def test_the_earliest_match_wins_whatever_the_lengths_and_the_order_of_the_stop_strings():
    matcher = StopStringMatcher(("a long stop string", "x"))
    assert matcher.find("ya long stop string x", len(" string x")) == 1
    assert matcher.find("yxa long stop string", len(" string")) == 1


def test_text_without_any_stop_string_has_no_match():
    assert StopStringMatcher(()).find("anything at all", 15) == -1
    assert _feed(StopStringMatcher(("stop", "end")), ["s to", "p", "s e", "nds"]) == (3, 7)
    assert _feed(StopStringMatcher(("stop",)), ["s to", "p", "s"]) == (-1, -1)
