"""What the engine reports about a request: a delta after each step, and the whole of it offline."""

from dataclasses import dataclass, field


@dataclass(slots=True)  # not frozen, as the others made every step (a frozen init is 4x slower)
class TokenLogprob:
    """A token's log-probability and its likeliest alternatives (most likely first). The core fills the ids and
    numbers; the output processor the texts (each token decoded alone), which the protocols show."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    token: str = ""
    top_tokens: list[str] = field(default_factory=list)  # the text of each of top_logprobs


@dataclass(slots=True)  # not frozen: one per request per step, and a frozen init is 4x slower
class RequestDelta:
    """What a step released of one request: text that can no longer change, the tokens behind it, and
    their logprobs (None unless asked for). Never changed after it is made.

    Text that could still be the start of a stop string, or is an incomplete character, is held back
    with its tokens until it is certain; a finished request's last delta releases everything left.
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop", "length" or "abort" on the last delta
    # Once, on the first delta after the prompt is prefilled, if asked for: None for the first token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_string: str | None = None  # on the last delta, the stop string that ended the output (not in `text`)
    num_cached_tokens: int | None = None  # once, with the first token: prompt tokens the prefix cache held
    embedding: list[float] | None = None  # an embedding request's one delta: its vector (no tokens, no text)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def merge(cls, deltas: "list[RequestDelta]") -> "RequestDelta":
        """Consecutive deltas of one request as one."""
        last = deltas[-1]
        if len(deltas) == 1:
            return last
        logprobs = None if last.logprobs is None else [entry for delta in deltas for entry in delta.logprobs]
        return cls(
            request_id=last.request_id,
            token_ids=[token_id for delta in deltas for token_id in delta.token_ids],
            text="".join(delta.text for delta in deltas),
            logprobs=logprobs,
            finish_reason=last.finish_reason,
            prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
            stop_string=last.stop_string,
            num_cached_tokens=next((d.num_cached_tokens for d in deltas if d.num_cached_tokens is not None), None),
            embedding=last.embedding,
        )


@dataclass(frozen=True)
class RequestOutput:
    """A whole request, as the offline API returns it: its deltas merged."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
