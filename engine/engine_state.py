"""What the console shows: a snapshot of the KV cache and the queues, and live figures over the last minute.

Both live on the engine thread. `StatsWindow` is fed the `StepStats` of every loop iteration (the same
ones the Prometheus metrics get) and keeps one-second buckets for a minute; per step it only adds
up counts and extends two lists, and a second's latencies become a histogram when the second ends.
`take_engine_state` reads the allocator and the scheduler, so it must run on the engine thread
between steps; the `EngineState` it returns is immutable and can be handed to any thread.
"""

import math
from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate

from kvserve.engine.stats import StepStats
from kvserve.kvcache import KVUsage
from kvserve.kvcache.block_map import BlockMap, block_ranges, build_block_map
from kvserve.scheduler import Request, RequestStatus, Scheduler

WINDOW_S = 60  # the live figures cover the last minute, in one-second samples
RATE_WINDOW_S = 10  # output tokens/s over the last ten seconds: recent, but not one noisy second
# Latencies are kept as counts in buckets 2% wide on a log scale, 10 µs to an hour: percentiles within 1%, memory
# bounded. A bisect per value (~0.1 µs, as the Prometheus histograms pay) when its second ends.
_BUCKET_RATIO = 1.02
_BUCKET_BOUNDS_S = [1e-5 * _BUCKET_RATIO**i for i in range(1000)]  # bucket i: (bounds[i-1], bounds[i]]
_bucket = partial(bisect_left, _BUCKET_BOUNDS_S)


@dataclass(frozen=True)
class Percentiles:
    count: int
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class LiveFigures:
    """The last `window_s` seconds from the engine's `StepStats`; each series has one sample a second, oldest first."""

    window_s: int
    output_tokens_per_s: float  # over the last RATE_WINDOW_S seconds
    time_to_first_token_s: Percentiles | None  # None: no first token in the window
    inter_token_latency_s: Percentiles | None
    prefix_cache_hit_rate: float | None  # hit / queried prompt tokens in the window; None: nothing queried
    # Speculative decoding in the window: tokens a request got from one verifying step (1 + accepted drafts a
    # verification); None: no drafts verified.
    spec_acceptance_length: float | None
    num_running: tuple[int, ...]  # queue sizes and KV usage at the end of each second
    num_waiting: tuple[int, ...]
    num_preempted_waiting: tuple[int, ...]
    kv_usage: tuple[float, ...]  # share of blocks in use
    num_output_tokens: tuple[int, ...]  # tokens generated in each second
    num_preemptions: tuple[int, ...]


@dataclass
class _Latencies:
    """One second's latencies: raw while the second fills, then counts in log-scale buckets."""

    raw: list[float] = field(default_factory=list)
    buckets: Counter = field(default_factory=Counter)

    def close(self) -> None:
        self.buckets.update(map(_bucket, self.raw))
        self.raw = []

    def add_to(self, buckets: Counter) -> None:
        buckets.update(self.buckets)
        buckets.update(map(_bucket, self.raw))


@dataclass
class _Second:
    """One second of `StepStats`: gauges as last reported, counts summed, latencies raw until it ends."""

    second: int
    gauges: tuple[int, int, int, float]  # running, waiting, preempted waiting, KV usage
    num_output_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_spec_drafts: int = 0  # verifications of drafts
    num_spec_accepted_tokens: int = 0
    time_to_first_token: _Latencies = field(default_factory=_Latencies)
    inter_token_latency: _Latencies = field(default_factory=_Latencies)

    def add(self, stats: StepStats) -> None:
        self.gauges = _gauges(stats)
        self.num_output_tokens += stats.num_generation_tokens
        self.num_preemptions += stats.num_preemptions
        self.prefix_cache_queried_tokens += stats.prefix_cache_queried_tokens
        self.prefix_cache_hit_tokens += stats.prefix_cache_hit_tokens
        if stats.spec_decode is not None:
            self.num_spec_drafts += stats.spec_decode.num_drafts
            self.num_spec_accepted_tokens += stats.spec_decode.num_accepted_tokens
        self.time_to_first_token.raw.extend(stats.time_to_first_token_s)
        self.inter_token_latency.raw.extend(stats.inter_token_latency_s)

    def close(self) -> None:
        """The second is over: its latencies become bucket counts (a busy engine reports thousands a second)."""
        self.time_to_first_token.close()
        self.inter_token_latency.close()


class StatsWindow:
    """One-second buckets of the last WINDOW_S seconds of `StepStats`. Engine thread only."""

    def __init__(self) -> None:
        self._seconds: deque[_Second] = deque()  # oldest first; the last one may still be filling
        self._gauges_before = (0, 0, 0, 0.0)  # as at the end of the last second that left the window

    def record(self, stats: StepStats, now_s: float) -> None:
        second = math.floor(now_s)
        if not self._seconds or self._seconds[-1].second != second:
            if self._seconds:
                self._seconds[-1].close()
            self._seconds.append(_Second(second, _gauges(stats)))
            self._drop_before(second - WINDOW_S + 1)
        self._seconds[-1].add(stats)

    def figures(self, now_s: float) -> LiveFigures:
        current = math.floor(now_s)
        self._drop_before(current - WINDOW_S + 1)
        by_second = {second.second: second for second in self._seconds}
        gauges, counts = [], []
        last_gauges = self._gauges_before
        for second in range(current - WINDOW_S + 1, current + 1):
            sample = by_second.get(second)
            last_gauges = sample.gauges if sample else last_gauges  # an idle engine reports nothing: unchanged
            gauges.append(last_gauges)
            counts.append((sample.num_output_tokens, sample.num_preemptions) if sample else (0, 0))
        num_running, num_waiting, num_preempted_waiting, kv_usage = zip(*gauges, strict=True)
        num_output_tokens, num_preemptions = zip(*counts, strict=True)
        rate_span_s = RATE_WINDOW_S - 1 + (now_s - current)  # whole seconds before this one, and this one so far
        queried = sum(second.prefix_cache_queried_tokens for second in self._seconds)
        hit = sum(second.prefix_cache_hit_tokens for second in self._seconds)
        drafts = sum(second.num_spec_drafts for second in self._seconds)
        accepted = sum(second.num_spec_accepted_tokens for second in self._seconds)
        return LiveFigures(
            window_s=WINDOW_S,
            output_tokens_per_s=sum(num_output_tokens[-RATE_WINDOW_S:]) / rate_span_s,
            time_to_first_token_s=_percentiles([second.time_to_first_token for second in self._seconds]),
            inter_token_latency_s=_percentiles([second.inter_token_latency for second in self._seconds]),
            prefix_cache_hit_rate=hit / queried if queried else None,
            spec_acceptance_length=1 + accepted / drafts if drafts else None,
            num_running=num_running,
            num_waiting=num_waiting,
            num_preempted_waiting=num_preempted_waiting,
            kv_usage=kv_usage,
            num_output_tokens=num_output_tokens,
            num_preemptions=num_preemptions,
        )

    def _drop_before(self, first_second: int) -> None:
        while self._seconds and self._seconds[0].second < first_second:
            self._gauges_before = self._seconds.popleft().gauges


@dataclass(frozen=True)
class RunningRequestState:
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    block_ranges: tuple[tuple[int, int], ...]  # its block table as runs of consecutive block ids, [start, end)
    num_preemptions: int
    num_unfilled_slots: int  # slots of its blocks that hold no computed token: the tail of its last block
    lora_name: str | None = None  # the LoRA adapter its blocks were computed under
    priority: int = 0  # lower runs first under the priority policy


@dataclass(frozen=True)
class EngineState:
    """The KV cache block by block, the running requests' blocks and the queues, as between two steps."""

    taken_at: float  # Unix time
    taken_at_monotonic_s: float
    block_map: BlockMap
    running: tuple[RunningRequestState, ...]  # in admission order, oldest first
    num_waiting: int
    num_preempted_waiting: int
    waiting_by_priority: tuple[tuple[int, int], ...]  # (priority, requests waiting) for each, lowest value first
    kv_usage: KVUsage
    prefix_cache_queried_tokens: int  # since the engine started
    prefix_cache_hit_tokens: int
    live: LiveFigures

    @property
    def block_size(self) -> int:
        return self.kv_usage.block_size

    @property
    def num_unfilled_slots(self) -> int:
        return sum(request.num_unfilled_slots for request in self.running)

    @property
    def fragmentation(self) -> float:
        """Share of the slots of held blocks that no token fills (the tails of last blocks); 0.0 when none is held."""
        num_held_slots = self.block_map.num_used_blocks * self.block_size
        return self.num_unfilled_slots / num_held_slots if num_held_slots else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else None


def take_engine_state(scheduler: Scheduler, window: StatsWindow, now_s: float, wall_time_s: float) -> EngineState:
    """Read the scheduler and its allocator; on the engine thread, between steps, only."""
    return EngineState(
        taken_at=wall_time_s,
        taken_at_monotonic_s=now_s,
        block_map=build_block_map(scheduler.allocator),
        running=tuple(_running_request_state(request, scheduler.block_size) for request in scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_preempted_waiting=sum(request.status is RequestStatus.PREEMPTED for request in scheduler.waiting),
        waiting_by_priority=tuple(sorted(Counter(request.priority for request in scheduler.waiting).items())),
        kv_usage=scheduler.kv_usage(),
        prefix_cache_queried_tokens=scheduler.prefix_cache_queried_tokens,
        prefix_cache_hit_tokens=scheduler.prefix_cache_hit_tokens,
        live=window.figures(now_s),
    )


def _running_request_state(request: Request, block_size: int) -> RunningRequestState:
    return RunningRequestState(
        request_id=request.request_id,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_output_tokens=len(request.output_token_ids),
        num_computed_tokens=request.num_computed_tokens,
        block_ranges=block_ranges(request.block_ids),
        num_preemptions=request.num_preemptions,
        num_unfilled_slots=len(request.block_ids) * block_size - request.num_computed_tokens,
        lora_name=request.lora.name if request.lora is not None else None,
        priority=request.priority,
    )


def _gauges(stats: StepStats) -> tuple[int, int, int, float]:
    return stats.num_running, stats.num_waiting, stats.num_preempted_waiting, stats.kv_usage.usage_fraction


def _percentiles(seconds: list[_Latencies]) -> Percentiles | None:
    """Nearest-rank percentiles over `seconds`, each reported at the geometric middle of its bucket."""
    buckets: Counter = Counter()
    for latencies in seconds:
        latencies.add_to(buckets)
    keys = sorted(buckets)
    cumulative = list(accumulate(buckets[key] for key in keys))
    if not cumulative:
        return None
    total = cumulative[-1]

    def at(fraction: float) -> float:
        bucket = min(keys[bisect_left(cumulative, fraction * total)], len(_BUCKET_BOUNDS_S) - 1)
        return _BUCKET_BOUNDS_S[bucket] / math.sqrt(_BUCKET_RATIO) if bucket else _BUCKET_BOUNDS_S[0]

    return Percentiles(count=total, p50=at(0.5), p90=at(0.9), p99=at(0.99))
