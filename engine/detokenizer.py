"""Incremental detokenization and stop strings for one request's output."""

from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one step at a time.

    Decoding a window that starts a few tokens back keeps the tokenizer's context (leading
    spaces, merged bytes); text ending in U+FFFD is an incomplete multi-byte character and
    is held back until the tokens that complete it arrive.
    """

    tokenizer: object
    skip_special_tokens: bool = True
    prefix_offset: int = 0
    read_offset: int = 0

    def decode_new(self, token_ids: list[int]) -> str:
        """Text added by the tokens appended since the last call ('' while a character is incomplete)."""
        decode = self.tokenizer.decode
        prefix_text = decode(
            token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens
        )
        full_text = decode(token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return full_text[len(prefix_text) :]


class StopStringFilter:
    """Releases a request's text as it grows, up to the first stop string.

    A stop string can only begin in text not yet released: each release holds back the longest tail
    that is the start of some stop string, so no released position can begin one. Each step therefore
    searches the held tail and the new text only, however long the output is.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
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
            stop_at = min((i for i in (pending.find(s) for s in self.stop) if i >= 0), default=-1)
            if stop_at >= 0:
                self._held = ""
                return pending[:stop_at], True
        num_held = self._num_pending_chars(pending)
        self._held = pending[len(pending) - num_held :]
        return pending[: len(pending) - num_held], False

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
