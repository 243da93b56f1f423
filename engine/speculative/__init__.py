"""Speculative decoding: proposers of draft tokens and the rule that verifies them."""

from kvserve.engine.speculative.config import SpeculativeConfig
from kvserve.engine.speculative.controller import SpeculationController
from kvserve.engine.speculative.ngram_proposer import NgramProposer
from kvserve.engine.speculative.proposer import Proposer, make_proposer
from kvserve.engine.speculative.suffix_proposer import SuffixProposer
from kvserve.engine.speculative.verification import grammars_after_drafts, num_accepted_drafts

__all__ = [
    "NgramProposer",
    "Proposer",
    "SpeculationController",
    "SpeculativeConfig",
    "SuffixProposer",
    "grammars_after_drafts",
    "make_proposer",
    "num_accepted_drafts",
]
