"""What one step of the engine core returns: the tokens each request got, and what was scheduled."""

from dataclasses import dataclass

from kvserve.engine.outputs import TokenLogprob
from kvserve.scheduler import FinishReason, SchedulerOutput


@dataclass(slots=True)  # not frozen: one per request per step, and a frozen init is 4x slower
class CoreOutput:
    """One request's news from a step: a new token, and whether the core finished it (a stop token, max_tokens,
    or a grammar that rejected the token). Stop strings are the output processor's: it sees the text."""

    request_id: str
    token_id: int
    logprob: TokenLogprob | None  # ids and numbers only, if the request asked for logprobs
    finish_reason: FinishReason | None  # STOP: the token is a stop token
    # Once, with the first output after the prompt was scored, if asked for: None for the first prompt token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int | None = None  # with the first token: prompt tokens the prefix cache held
    embedding: list[float] | None = None  # an embedding request's vector (its token is none: `token_id` is -1)


@dataclass(frozen=True)
class StepResult:
    # One per token a request got, in schedule order: one per request that sampled, or with speculative decoding
    # several in a row for a request whose drafts were accepted (up to a token that finished it).
    outputs: list[CoreOutput]
    scheduled: SchedulerOutput  # what ran: the batch, its tokens (drafts among them), the preemptions
    num_accepted_draft_tokens: int = 0  # of the scheduled draft tokens, those verification accepted

    @property
    def ran_model(self) -> bool:
        return not self.scheduled.is_empty


EMPTY_STEP = StepResult([], SchedulerOutput(scheduled=[]))
