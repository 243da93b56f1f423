"""What the scheduler decided for one step."""

from dataclasses import dataclass, field

from scheduler.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    """Run `num_new_tokens` tokens of `request`, starting at its `num_computed_tokens`."""

    request: Request
    num_new_tokens: int

    @property
    def start_position(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples_next_token(self) -> bool:
        """True when this chunk reaches the request's last token, so its logits give the next one."""
        return self.start_position + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
