"""What the scheduler decided for one step, and its queues between steps."""

from dataclasses import dataclass, field

from kvserve.kvcache import KVUsage
from kvserve.scheduler.request import Request


@dataclass(slots=True)  # not frozen: one per request per step, and a frozen init is 4x slower
class ScheduledRequest:
    """Run `num_new_tokens` tokens of `request` from `start_position`, as decided when scheduling
    (never changed after).

    `samples_next_token` is True when this chunk reaches the request's last token, so its logits
    give the next one (False for all but the last chunk of a chunked prefill).
    `num_draft_tokens`: of a decode's `num_new_tokens`, how many are the request's first draft tokens (speculative
    decoding), run after its last token so that one forward checks them all; their KV counts only once accepted.
    """

    request: Request
    num_new_tokens: int
    start_position: int
    samples_next_token: bool
    num_draft_tokens: int = 0

    @classmethod
    def of(cls, request: Request, num_new_tokens: int) -> "ScheduledRequest":
        start = request.num_computed_tokens
        return cls(request, num_new_tokens, start, start + num_new_tokens == request.num_tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    """`left_running`: ids of the requests that left the running batch (finished, aborted or preempted)
    since the previous output, so whoever keeps per-request state for running requests can drop it."""

    scheduled: list[ScheduledRequest]
    preempted: list[Request] = field(default_factory=list)
    left_running: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class LoraRequestCounts:
    """Requests per LoRA adapter name, running and waiting; `max_loras`: adapters a step may run at once."""

    max_loras: int
    running: dict[str, int]
    waiting: dict[str, int]


@dataclass(frozen=True)
class PriorityRequestCounts:
    """Requests per priority value, running and waiting (under the priority policy)."""

    running: dict[int, int]
    waiting: dict[int, int]


@dataclass(frozen=True)
class SchedulerStats:
    """The queues and the KV cache as they are between two steps."""

    num_running: int
    num_waiting: int
    num_preempted_waiting: int  # waiting again after a preemption, to be recomputed
    kv_usage: KVUsage
    prefix_cache_queried_tokens: int  # totals since start
    prefix_cache_hit_tokens: int
    lora_requests: LoraRequestCounts | None = None  # when the engine serves LoRA adapters
    priority_requests: PriorityRequestCounts | None = None  # under the priority policy
