"""Prompt lookup (n-gram) proposals: text that repeats, such as code being edited, a passage being quoted or a
list being continued, is likely to go on as it went on before."""

import numpy as np

from kvserve.engine.speculative.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """`max_tokens` tokens that follow the latest earlier occurrence of the last n of `token_ids` (n from the
        largest size down; the first size that occurs wins), as the text would go on if it repeated with the period
        that occurrence shows (a loop of one token, or of a phrase, runs on past the end); none if no size occurs."""
        length = len(token_ids)
        if max_tokens < 1 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Where earlier occurrences of the last n tokens end, before the last token (so that one follows each): the
        # last token's occurrences, then those that match one token further back, for n = 1, 2, ... max_n. Run once
        # over the text and then over ever fewer candidates, where a window per size compared the whole text
        # (10-16 us against 50-70 us for 300 tokens; it runs for every decoding request of a step with drafts).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        latest_end = -1
        for n in range(1, self.max_n + 1):
            if n > 1:
                ends = ends[ends >= n - 1]
                ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
            if not ends.size:
                break
            if n >= self.min_n:
                latest_end = int(ends[-1])
        if latest_end < 0:
            return []
        # The text from the occurrence on, repeated: position j takes position j - period's token, the proposal's
        # own ones included once j - period passes the end.
        period = length - 1 - latest_end
        proposal: list[int] = []
        for j in range(length, length + max_tokens):
            proposal.append(token_ids[j - period] if j - period < length else proposal[j - period - length])
        return proposal

    def finished(self, output_token_ids: list[int]) -> None:
        """Prompt lookup looks at one request's own tokens only."""
