"""What the engine asks of a proposer of draft tokens, and the proposer a config names."""

from typing import Protocol

from kvserve.engine.speculative.config import SpeculativeConfig
from kvserve.engine.speculative.ngram_proposer import NgramProposer
from kvserve.engine.speculative.suffix_proposer import SuffixProposer


class Proposer(Protocol):
    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens likely to follow `token_ids`, a request's prompt and output so far."""

    def finished(self, output_token_ids: list[int]) -> None:
        """A request left with this output (a proposer that learns across requests keeps it)."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    return SuffixProposer(config) if config.method == "suffix" else NgramProposer(config)
