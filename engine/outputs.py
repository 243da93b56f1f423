"""What the engine reports about a request after each step."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass(frozen=True)
class RequestOutput:
    """A snapshot of one request: everything generated so far, and why it finished if it did."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop", "length" or "abort"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
