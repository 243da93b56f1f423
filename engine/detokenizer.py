"""Incremental detokenization and stop-string matching for one request's output."""

from dataclasses import dataclass, field

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


@dataclass
class StopStringMatcher:
    """Finds the earliest stop string in text that grows at its end."""

    stop: tuple[str, ...]
    longest: int = field(init=False)

    def __post_init__(self) -> None:
        self.longest = max((len(s) for s in self.stop), default=0)

    def find(self, text: str, num_new_chars: int) -> int:
        """Index in `text` where a stop string begins, or -1.

        Only the tail where the `num_new_chars` last characters could complete a stop string is searched.
        """
        if not self.stop or not num_new_chars:
            return -1
        search_from = max(0, len(text) - num_new_chars - self.longest + 1)
        hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
        return min(hits, default=-1)

    def num_pending_chars(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string: not safe to show yet."""
        for length in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0
