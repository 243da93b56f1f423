"""How the engine speculates: vLLM's `speculative_config` keys for the methods kvserve has."""

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the request's last
        n tokens, in its prompt or output, are proposed to come next).
    num_speculative_tokens: the most draft tokens a request verifies in one step.
    prompt_lookup_min, prompt_lookup_max: the n-gram sizes tried, longest first.
    adaptive: fit each request's drafts to its acceptance and speculate only at batch sizes where it measurably
        pays (engine/speculative/controller.py); False: every decoding request gets what the proposer finds (in
        steps where no prompt waits for the budget).
    """

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config.method must be ngram, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
