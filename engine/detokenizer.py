"""Incremental detokenization and stop strings for one request's output."""

from tokenizers.decoders import DecodeStream


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's special tokens: the ones decoding skips with `skip_special_tokens`."""
    added = tokenizer.backend_tokenizer.get_added_tokens_decoder().items()
    return frozenset(token_id for token_id, token in added if token.special)


class IncrementalDetokenizer:
    """Turns a request's output tokens into text as they arrive, one token at a time.

    The tokenizers library's `DecodeStream` keeps the tokenizer's context (leading spaces, merged
    bytes) over a short window and holds back an incomplete multi-byte character until the tokens
    that complete it arrive: one call into the Rust tokenizer per token, however long the output.
    """

    def __init__(self, tokenizer, special_ids: frozenset[int], skip_special_tokens: bool = True) -> None:
        """`special_ids`: `special_token_ids(tokenizer)`, computed once per tokenizer, not per request."""
        self._tokenizer = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._skipped_ids = special_ids if skip_special_tokens else frozenset()
        # Whether text of tokens already pushed may still come (an incomplete character). A skipped special
        # token adds no text of its own and leaves this as it was.
        self.holds_text = False

    def push(self, token_id: int) -> str:
        """The text `token_id` adds ('' while a character is incomplete, and for a skipped special token)."""
        text = self._stream.step(self._tokenizer, token_id) or ""
        if token_id not in self._skipped_ids:
            self.holds_text = not text
        return text


class StopStringFilter:
    """Releases a request's text as it grows, up to the first stop string.

    A stop string can only begin in text not yet released: each release holds back the longest tail
    that is the start of some stop string, so no released position can begin one. Each step therefore
    searches the held tail and the new text only, however long the output is.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.matched: str | None = None  # the stop string that ended the text (the first to begin, on a tie)
        self._held = ""

    def push(self, new_text: str, can_stop: bool) -> tuple[str, bool]:
        """(the text `new_text` releases, whether a stop string ended the text there).

        Before `can_stop` (min_tokens not reached) stop strings do not end the text, but a possible
        start of one is still held back.
        """
        if not self.stop:
            return new_text, False
        pending = self._held + new_text
        if can_stop:
            found = [(index, stop) for stop in self.stop if (index := pending.find(stop)) >= 0]
            if found:
                stop_at, self.matched = min(found, key=lambda item: item[0])
                self._held = ""
                return pending[:stop_at], True
        num_held = self._num_pending_chars(pending)
        self._held = pending[len(pending) - num_held :]
        return pending[: len(pending) - num_held], False

    @property
    def holds_text(self) -> bool:
        """Whether released text stops short of what was pushed (it may begin a stop string)."""
        return bool(self._held)

    def flush(self) -> str:
        """Everything held back: the text ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _num_pending_chars(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        longest = max(len(s) for s in self.stop)
        for length in range(min(longest - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0
