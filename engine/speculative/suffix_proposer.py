"""Suffix decoding (Oliaro et al., arXiv 2411.04975): match the longest suffix of a request's text, up to
`max_depth` tokens, against its own prompt and output and against a pool of recent requests' outputs, and
propose the continuation seen most often after it, token by token, while that token followed at least
`min_token_prob` of the matches. A longer match earns a longer proposal (`max_spec_factor` tokens per matched
token): agents, tools and templates repeat whole passages across requests, which prompt lookup in one request
cannot see.

The paper keeps suffix trees; here matches are found by filtering occurrences backwards, a token at a time, over
the request's tokens (numpy, like the n-gram proposer) and over the pool (through an index of its token pairs),
which answers the same question (every occurrence of the matched suffix and what followed it) without a tree's
memory of tens of nodes per token.
"""

from array import array
from collections import deque
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from kvserve.engine.speculative.config import SpeculativeConfig

END = -1  # what follows the last token of a pooled output: no token, so a proposal stops there
MAX_POOL_MATCHES = 512  # pool occurrences of a pair examined, the newest first: bounds a step's work


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    expected_accepted: float  # the sum over its tokens of the product of their frequencies so far

    @classmethod
    def none(cls) -> "Proposal":
        return cls([], 0.0)


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.pool = OutputPool(config.suffix_decoding_max_cached_requests)

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens to follow `token_ids` (a request's prompt and output so far): whichever of
        the request's own text and the pool promises more accepted tokens."""
        if max_tokens < 1 or not token_ids:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        own = self._continue(tokens, tokens, _occurrences_in(tokens), max_tokens)
        pooled = self._continue(tokens, self.pool.tokens, self.pool.occurrences(tokens), max_tokens)
        return max(own, pooled, key=lambda proposal: proposal.expected_accepted).token_ids

    def finished(self, output_token_ids: list[int]) -> None:
        """A request left: its output joins the pool (the oldest output leaves a full pool)."""
        if output_token_ids:
            self.pool.add(output_token_ids)

    def forget_outputs(self) -> None:
        """Empty the pool (a benchmark's runs must not draft from each other's answers)."""
        self.pool = OutputPool(self.pool.max_outputs)

    def _continue(self, tokens: np.ndarray, text: np.ndarray, ends: np.ndarray, max_tokens: int) -> Proposal:
        """The proposal from `text`, given `ends`: the positions in `text` where the last token of `tokens` occurs
        (each followed by a token of `text` or of the proposal, or by END). The match is the longest agreement
        backwards, up to max_depth tokens, of any occurrence; then the most frequent next token is taken while
        frequent enough."""
        if not ends.size:
            return Proposal.none()
        # How far back each occurrence agrees with the text's end (all at once: [occurrences, depth]); the longest
        # agreements are the match.
        back = np.arange(min(self.max_depth, len(tokens)))
        positions = ends[:, None] - back
        agrees = (positions >= 0) & (text[np.maximum(positions, 0)] == tokens[-1 - back])
        lengths = np.cumprod(agrees, axis=1).sum(axis=1)
        match_len = int(lengths.max())
        ends = ends[lengths == match_len]
        limit = min(max_tokens, int(self.max_spec_factor * match_len))
        if limit < 1:
            return Proposal.none()
        # The `limit` tokens after each occurrence, read at once; then the walk over the few occurrences a match
        # leaves runs on Python lists, where a numpy call a token cost more than the work (a proposal from a
        # 300-token request and a pool of 7 outputs: 91-98 us against 114-120 us). In the request's own text the
        # latest occurrences may run into the proposal itself, from step `len(text) - end - 1` on: a loop then goes
        # on with its period, as the text would if it repeated.
        after = text[np.minimum(ends[:, None] + np.arange(1, limit + 1), len(text) - 1)].tolist()
        occurrences = list(zip(after, (len(text) - ends - 1).tolist(), strict=True))
        proposal, expected, likelihood = [], 0.0, 1.0
        for step in range(limit):
            following = [
                next_tokens[step] if step < past_end else proposal[step - past_end]
                for next_tokens, past_end in occurrences
            ]
            token, count = _most_frequent(following)
            frequency = count / len(occurrences)
            if token == END or frequency < self.min_token_prob:
                break
            likelihood *= frequency
            expected += likelihood
            proposal.append(token)
            occurrences = [
                occurrence for occurrence, value in zip(occurrences, following, strict=True) if value == token
            ]
        return Proposal(proposal, expected)


def _most_frequent(values: list[int]) -> tuple[int, int]:
    """The most frequent of `values` and its count; of equally frequent ones, the one that occurs last (after a
    match, `values` are in text order). A dict, not np.unique: after a match there are few values."""
    counts: dict[int, int] = {}
    last_seen: dict[int, int] = {}
    for index, value in enumerate(values):
        counts[value] = counts.get(value, 0) + 1
        last_seen[value] = index
    best = max(counts, key=lambda value: (counts[value], last_seen[value]))
    return best, counts[best]


def _occurrences_in(tokens: np.ndarray) -> np.ndarray:
    """Where the last token occurs earlier in `tokens` (so that a token follows each occurrence)."""
    return np.flatnonzero(tokens[:-1] == tokens[-1])


class OutputPool:
    """The outputs of the last `max_outputs` requests, end to end (each followed by END), and where each pair of
    consecutive tokens occurs in them (about 16 bytes a pooled token in all). Dropped outputs leave the index at
    once and the array in bulk, once the dropped part is as long as the kept one."""

    def __init__(self, max_outputs: int) -> None:
        self.max_outputs = max_outputs
        self._buffer = np.empty(1024, dtype=np.int64)  # grown by doubling: adding an output copies only it
        self._length = 0
        self._offset = 0  # the pool position of self._buffer[0]
        self._spans: deque[tuple[int, int]] = deque()  # each pooled output's (start, end) positions, oldest first
        self._pairs: dict[int, array] = {}  # pair key -> the positions of its second token, ascending

    @property
    def tokens(self) -> np.ndarray:
        return self._buffer[: self._length]

    def add(self, token_ids: list[int]) -> None:
        if self.max_outputs == 0:
            return
        start, needed = self._offset + self._length, self._length + len(token_ids) + 1
        if needed > len(self._buffer):
            grown = np.empty(max(needed, 2 * len(self._buffer)), dtype=np.int64)
            grown[: self._length] = self.tokens
            self._buffer = grown
        self._buffer[self._length : needed] = [*token_ids, END]
        self._length = needed
        for position, (first, second) in enumerate(pairwise(token_ids), start=start + 1):
            self._pairs.setdefault(_pair_key(first, second), array("q")).append(position)
        self._spans.append((start, start + len(token_ids)))
        while len(self._spans) > self.max_outputs:
            self._drop_oldest()

    def occurrences(self, tokens: np.ndarray) -> np.ndarray:
        """Indices into `self.tokens` where the last two of `tokens` end, the newest MAX_POOL_MATCHES."""
        positions = self._pairs.get(_pair_key(int(tokens[-2]), int(tokens[-1]))) if len(tokens) >= 2 else None
        if not positions:
            return np.empty(0, dtype=np.int64)
        return np.frombuffer(positions, dtype=np.int64)[-MAX_POOL_MATCHES:] - self._offset

    def _drop_oldest(self) -> None:
        start, end = self._spans.popleft()
        dropped = self.tokens[start - self._offset : end - self._offset].tolist()
        for first, second in pairwise(dropped):
            key = _pair_key(first, second)
            positions = self._pairs[key]
            del positions[0]  # the oldest output's occurrences are each pair's first, in order
            if not positions:
                del self._pairs[key]
        first_kept = self._spans[0][0] if self._spans else self._offset + self._length
        num_dropped = first_kept - self._offset
        if num_dropped >= self._length // 2:
            kept = self._length - num_dropped
            self._buffer[:kept] = self._buffer[num_dropped : self._length]
            self._length, self._offset = kept, first_kept


def _pair_key(first: int, second: int) -> int:
    return first << 32 | second
