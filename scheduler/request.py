"""A request's token state as the scheduler sees it."""

import enum
from dataclasses import dataclass, field

from kvserve.kvcache import AdapterTag, BlockKey


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed from scratch
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    """Token ids and KV progress of one request.

    `num_computed_tokens` counts tokens whose K and V are in the cache; the tokens after it
    (the whole prompt at first, then the last sampled token) are what the next step computes.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    block_keys: list[BlockKey] = field(default_factory=list)  # contents of the full blocks known so far
    num_registered_blocks: int = 0  # leading blocks of block_ids that the prefix cache can find
    reuses_cached_prefix: bool = True  # False: computes its whole prompt
    cache_salt: str | None = None  # shares cached blocks only with requests of the same salt
    caches_blocks: bool = True  # False: its blocks are not offered to the prefix cache
    lora: AdapterTag | None = None  # the LoRA adapter it runs under; None: the base model
    priority: int = 0  # under the priority policy, lower runs first (and is preempted last)
    arrival_index: int = 0  # its place in the order of arrival, set by Scheduler.add
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when it was first admitted
    # Speculative decoding: tokens proposed to follow the last output token, run in the next step beside it so that
    # one forward verifies them (as many as fit); the engine core sets them before every schedule.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end) over prompt followed by output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
