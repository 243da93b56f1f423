"""Prompt lookup (n-gram) proposals: text that repeats, such as code being edited, a passage being quoted or a
list being continued, is likely to go on as it went on before."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvserve.engine.speculative.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the last n of `token_ids`
        (n from the largest size down; the first size that occurs wins); none if no size occurs."""
        if max_tokens < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows that end before the last token, so that at least one token follows each.
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                follower = int(starts[-1]) + n
                return tokens[follower : follower + max_tokens].tolist()
        return []
