"""Plain engine statistics, for whoever exports them (the server's Prometheus recorder).

`StatsTracker` lives on the engine thread: the async engine tells it when requests arrive, step and
finish, and after each loop iteration it hands over one `StepStats` with what happened since the
last one. Nothing here knows about Prometheus or HTTP; the work per step is a few dict look-ups
per scheduled request, so it costs the loop next to nothing.
"""

from collections import Counter
from dataclasses import dataclass, field

from kvserve.engine.step_result import StepResult
from kvserve.kvcache import KVUsage
from kvserve.scheduler import LoraRequestCounts, PriorityRequestCounts, SchedulerStats

# Reasons a request can finish with; "error" is a failed step or a request the engine refused late.
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class CompletedRequestStats:
    """Timings and lengths of a request that ran to a stop condition or to max_tokens.

    queue: arrival to first scheduled; prefill: first scheduled to first token; decode: first to
    last token; end-to-end: arrival to last token. Aborted and failed requests are not described
    here: their times tell how long a client waited, not how long the server took.
    """

    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency_s: float
    queue_time_s: float
    prefill_time_s: float
    decode_time_s: float


@dataclass
class SpecDecodeCounts:
    """Speculative decoding (vLLM's counters): requests that verified drafts in a step (one each per step), the
    draft tokens verified, and those accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(frozen=True)
class StepStats:
    """One engine loop iteration: the queues and KV cache after it, and what it added up to."""

    num_running: int
    num_waiting: int
    num_preempted_waiting: int  # waiting again after a preemption, to be recomputed
    kv_usage: KVUsage
    num_batched_requests: int  # requests in this iteration's model step; 0 when nothing ran
    num_batched_tokens: int  # tokens computed in that step
    num_prompt_tokens: int  # prompts whose prefill finished (they produced their first token)
    num_generation_tokens: int
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    time_to_first_token_s: list[float] = field(default_factory=list)
    inter_token_latency_s: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)  # one per request that finished, any reason
    completed: list[CompletedRequestStats] = field(default_factory=list)
    # Tokens routed to each expert (summed over MoE layers) since the last report that had them; empty in the
    # reports between (they are read about once a second) and for models without experts.
    expert_tokens: list[int] = field(default_factory=list)
    num_dropped_kv_events: int = 0  # KV-cache events the publisher's full queue turned away
    lora_requests: LoraRequestCounts | None = None  # requests per LoRA adapter, when the engine serves adapters
    priority_requests: PriorityRequestCounts | None = None  # requests per priority, under the priority policy
    spec_decode: SpecDecodeCounts | None = None  # speculative decoding's drafts since the last report, if any


@dataclass
class _RequestTimes:
    arrival_s: float
    num_prompt_tokens: int
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float = 0.0
    num_generation_tokens: int = 0


class StatsTracker:
    """Collects request timings and step counts between two `collect` calls. Engine thread only."""

    def __init__(self) -> None:
        self._times: dict[str, _RequestTimes] = {}
        self._pending = _Pending()
        self._prefix_cache_queried_tokens = 0  # the scheduler's running totals at the last collect
        self._prefix_cache_hit_tokens = 0
        self._num_dropped_kv_events = 0  # the publisher's running total at the last collect

    def arrived(self, request_id: str, num_prompt_tokens: int, arrival_s: float) -> None:
        self._times[request_id] = _RequestTimes(arrival_s, num_prompt_tokens)

    def stepped(self, result: StepResult, start_s: float, end_s: float) -> None:
        """Account for one model step: what it batched, the tokens it produced (at `end_s`; held back or
        not) and the requests it finished."""
        pending, output = self._pending, result.scheduled
        # One model step per loop iteration, so these describe that step (for the per-step histograms).
        pending.num_batched_requests = len(output.scheduled)
        pending.num_batched_tokens = output.num_batched_tokens
        pending.num_preemptions += len(output.preempted)
        embedded = {out.request_id for out in result.outputs if out.embedding is not None}
        tokens_per_request = None  # a step with drafts: how many tokens each request got
        for item in output.scheduled:
            times = self._times.get(item.request.request_id)
            if times is not None and times.first_scheduled_s is None:
                times.first_scheduled_s = start_s
            num_tokens = 1
            if item.num_draft_tokens:
                if tokens_per_request is None:
                    tokens_per_request = Counter(out.request_id for out in result.outputs)
                    pending.spec_decode = pending.spec_decode or SpecDecodeCounts()
                    pending.spec_decode.num_accepted_tokens += result.num_accepted_draft_tokens
                num_tokens = tokens_per_request[item.request.request_id]
                pending.spec_decode.num_drafts += 1
                pending.spec_decode.num_draft_tokens += item.num_draft_tokens
            if times is not None and item.samples_next_token:
                self._on_token(times, end_s, generated=item.request.request_id not in embedded, num_tokens=num_tokens)
        for core_output in result.outputs:
            if core_output.finish_reason is not None:
                self.finished(core_output.request_id, core_output.finish_reason.value)

    def finished(self, request_id: str, reason: str) -> None:
        """A request that ended, in a step or outside one (abort, failure)."""
        times = self._times.pop(request_id, None)
        if times is None:
            return
        self._pending.finish_reasons.append(reason)
        if reason in ("stop", "length"):
            self._pending.completed.append(_completed(times))

    def collect(
        self, queues: SchedulerStats, expert_tokens: list[int] | None = None, num_dropped_kv_events: int = 0
    ) -> StepStats:
        """Everything since the last call, with the queues and KV cache as they are now (`num_dropped_kv_events`:
        the publisher's total so far)."""
        pending, self._pending = self._pending, _Pending()
        queried, hit = queues.prefix_cache_queried_tokens, queues.prefix_cache_hit_tokens
        stats = StepStats(
            num_running=queues.num_running,
            num_waiting=queues.num_waiting,
            num_preempted_waiting=queues.num_preempted_waiting,
            kv_usage=queues.kv_usage,
            num_batched_requests=pending.num_batched_requests,
            num_batched_tokens=pending.num_batched_tokens,
            num_prompt_tokens=pending.num_prompt_tokens,
            num_generation_tokens=pending.num_generation_tokens,
            num_preemptions=pending.num_preemptions,
            prefix_cache_queried_tokens=queried - self._prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=hit - self._prefix_cache_hit_tokens,
            time_to_first_token_s=pending.time_to_first_token_s,
            inter_token_latency_s=pending.inter_token_latency_s,
            finish_reasons=pending.finish_reasons,
            completed=pending.completed,
            expert_tokens=expert_tokens or [],
            num_dropped_kv_events=num_dropped_kv_events - self._num_dropped_kv_events,
            lora_requests=queues.lora_requests,
            priority_requests=queues.priority_requests,
            spec_decode=pending.spec_decode,
        )
        self._num_dropped_kv_events = num_dropped_kv_events
        self._prefix_cache_queried_tokens, self._prefix_cache_hit_tokens = queried, hit
        return stats

    def _on_token(self, times: _RequestTimes, now_s: float, generated: bool = True, num_tokens: int = 1) -> None:
        """`num_tokens` came out of a step for one request (several: accepted drafts); `generated` False: an
        embedding came out, no token (its prompt and time to it still count). One inter-token latency a step."""
        pending = self._pending
        pending.num_generation_tokens += generated * num_tokens
        times.num_generation_tokens += generated * num_tokens
        if times.first_token_s is None:
            times.first_token_s = now_s
            pending.num_prompt_tokens += times.num_prompt_tokens
            pending.time_to_first_token_s.append(now_s - times.arrival_s)
        else:
            pending.inter_token_latency_s.append(now_s - times.last_token_s)
        times.last_token_s = now_s


@dataclass
class _Pending:
    """What happened since the last `collect`."""

    num_batched_requests: int = 0
    num_batched_tokens: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    time_to_first_token_s: list[float] = field(default_factory=list)
    inter_token_latency_s: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    completed: list[CompletedRequestStats] = field(default_factory=list)
    spec_decode: SpecDecodeCounts | None = None


def _completed(times: _RequestTimes) -> CompletedRequestStats:
    # A request that produced a token was scheduled and has a first token.
    first_scheduled_s, first_token_s = times.first_scheduled_s, times.first_token_s
    return CompletedRequestStats(
        num_prompt_tokens=times.num_prompt_tokens,
        num_generation_tokens=times.num_generation_tokens,
        e2e_latency_s=times.last_token_s - times.arrival_s,
        queue_time_s=first_scheduled_s - times.arrival_s,
        prefill_time_s=first_token_s - first_scheduled_s,
        decode_time_s=times.last_token_s - first_token_s,
    )
