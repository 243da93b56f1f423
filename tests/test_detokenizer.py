"""Incremental detokenization of multi-byte text, and stop strings that arrive in pieces."""

from importlib import resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.detokenizer import IncrementalDetokenizer, StopStringFilter, special_token_ids

REPLACEMENT_CHAR = "\ufffd"  # what a decode of an incomplete multi-byte character ends with
CORPUS = resources.files("kvserve.engine").joinpath("assets/corpus.txt").read_text(encoding="utf-8")
# Beyond the corpus: characters the tokenizer never merged, so each is split into single-byte tokens.
UNSEEN_TEXTS = [
    "日本語のテキスト 🎉🎉 Ωμέγα ñandú 𝄞𓀀",
    "👩‍👩‍👧‍👦 family, 🇫🇷 flag, e\u0301 combining accent",
    "ÆØÅ æøå — “quotes” … € ₿ ∑ ∞",
]


def _stream(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """What the detokenizer emits after each token is appended."""
    detokenizer = IncrementalDetokenizer(tokenizer, special_token_ids(tokenizer), skip_special_tokens)
    return [detokenizer.push(token_id) for token_id in token_ids]


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


def test_holds_text_while_a_character_is_incomplete_and_a_special_token_leaves_it_as_it_was(tokenizer):
    emoji = tokenizer.encode("🎉", add_special_tokens=False)
    word = tokenizer.encode("ok", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, special_token_ids(tokenizer), skip_special_tokens=True)
    eos = tokenizer.eos_token_id
    holds = []
    for token_id in [*word, eos, emoji[0], eos, *emoji[1:], eos]:
        detokenizer.push(token_id)
        holds.append(detokenizer.holds_text)
    # After "ok" and after its EOS nothing is pending; from the emoji's first byte until its last, something is
    # (the EOS in between changes nothing); after the last byte and the final EOS, nothing again.
    assert holds == [False] * (len(word) + 1) + [True, True] + [True] * (len(emoji) - 2) + [False, False]


def test_a_kept_special_token_is_text_like_any_other(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, special_token_ids(tokenizer), skip_special_tokens=False)
    assert detokenizer.push(tokenizer.eos_token_id) == "<|eos|>" and not detokenizer.holds_text


def _feed(stop_filter: StopStringFilter, pieces: list[str]) -> tuple[int, str]:
    """Push the pieces one by one: (index of the piece that completed a stop string or -1, all text released)."""
    released = ""
    for i, piece in enumerate(pieces):
        text, stopped = stop_filter.push(piece, can_stop=True)
        released += text
        if stopped:
            return i, released
    return -1, released + stop_filter.flush()


def test_a_stop_string_split_across_several_increments_is_found_when_its_last_piece_arrives():
    pieces = ["Once upon a ti", "me th", "e", "re was a town"]
    assert _feed(StopStringFilter(("time there",)), pieces) == (3, "Once upon a ")


def test_a_stop_string_arriving_one_character_at_a_time_is_found():
    text = "the end of the story"
    assert _feed(StopStringFilter(("the story",)), list(text)) == (len(text) - 1, text[: text.index("the story")])


def test_a_multi_byte_stop_string_is_found():
    pieces = ["🚀 ", "こんにち", "は世", "界"]
    assert _feed(StopStringFilter(("は世界",)), pieces) == (3, "🚀 こんにち")


def test_the_earliest_of_several_stop_strings_wins():
    assert _feed(StopStringFilter(("world", "o w", "Hello there")), ["Hello world"]) == (0, "Hell")


def test_the_earliest_match_wins_whatever_the_lengths_and_the_order_of_the_stop_strings():
    assert _feed(StopStringFilter(("a long stop string", "x")), ["ya long stop", " string x"]) == (1, "y")
    assert _feed(StopStringFilter(("a long stop string", "x")), ["yxa long stop", " string"]) == (0, "y")


def test_text_without_any_stop_string_has_no_match():
    assert _feed(StopStringFilter(()), ["anything at all"]) == (-1, "anything at all")
    assert _feed(StopStringFilter(("stop", "end")), ["s to", "p", "s e", "nds"]) == (3, "s tops ")
    assert _feed(StopStringFilter(("stop",)), ["s to", "p", "s"]) == (-1, "s tops")


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot():
    stop_filter = StopStringFilter(("stop here",))
    assert stop_filter.push("we st", can_stop=True) == ("we ", False)  # "st" may begin it
    assert stop_filter.holds_text
    assert stop_filter.push("op h", can_stop=True) == ("", False)  # "stop h" still may
    assert stop_filter.push("ollow", can_stop=True) == ("stop hollow", False)  # now it cannot
    assert not stop_filter.holds_text
    assert stop_filter.push(" stop here", can_stop=True) == (" ", True)


def test_before_min_tokens_a_stop_string_is_plain_text_though_its_start_is_still_held_back():
    stop_filter = StopStringFilter(("end",))
    assert stop_filter.push("the e", can_stop=False) == ("the ", False)
    assert stop_filter.push("nd", can_stop=False) == ("end", False)  # whole, but not allowed to stop yet
    assert stop_filter.push(" e", can_stop=True) == (" ", False)
    assert stop_filter.push("nd", can_stop=True) == ("", True)


def test_the_stop_string_that_ended_the_text_is_named():
    stop_filter = StopStringFilter(("o w", "world", "Hello there"))
    assert stop_filter.matched is None
    assert stop_filter.push("Hello world", can_stop=True) == ("Hell", True)
    assert stop_filter.matched == "o w"  # begins first, though "world" is listed after it and also matches
    late = StopStringFilter(("end",))
    late.push("the e", can_stop=False)
    late.push("nd", can_stop=False)
    assert late.matched is None  # whole, but not allowed to stop yet
