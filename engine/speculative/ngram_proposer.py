"""Prompt lookup (n-gram) proposals: text that repeats, such as code being edited, a passage being quoted or a
list being continued, is likely to go on as it went on before."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvserve.engine.speculative.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """`max_tokens` tokens that follow the latest earlier occurrence of the last n of `token_ids` (n from the
        largest size down; the first size that occurs wins), as the text would go on if it repeated with the period
        that occurrence shows (a loop of one token, or of a phrase, runs on past the end); none if no size occurs."""
        if max_tokens < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows that end before the last token, so that at least one token follows each.
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                # The text from the occurrence on, repeated: position j takes position j - period's token, the
                # proposal's own ones included once j - period passes the end.
                length, period = len(tokens), len(tokens) - n - int(starts[-1])
                proposal: list[int] = []
                for j in range(length, length + max_tokens):
                    proposal.append(int(tokens[j - period]) if j - period < length else proposal[j - period - length])
                return proposal
        return []

    def finished(self, output_token_ids: list[int]) -> None:
        """Prompt lookup looks at one request's own tokens only."""
