"""StatsTracker: request timings and step counts, over a real scheduler, with the clock given by the test."""

import pytest

from kvserve.engine.stats import StatsTracker, StepStats
from kvserve.engine.step_result import CoreOutput, StepResult
from kvserve.kvcache import BlockAllocator
from kvserve.scheduler import FinishReason, Request, Scheduler, SchedulerConfig

BLOCK_SIZE = 4


class Harness:
    """A scheduler and a tracker, stepped the way the async engine steps them (minus the model)."""

    def __init__(self, num_blocks: int = 64, max_num_batched_tokens: int = 64) -> None:
        config = SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
            watermark_blocks=0,
            enable_chunked_prefill=True,
            enable_prefix_caching=True,
        )
        self.scheduler = Scheduler(config, BlockAllocator(num_blocks), BLOCK_SIZE)
        self.tracker = StatsTracker()

    def add(self, request_id: str, num_prompt_tokens: int, arrival_s: float) -> None:
        prompt = list(range(1, num_prompt_tokens + 1))
        self.scheduler.add(Request(request_id=request_id, prompt_token_ids=prompt))
        self.tracker.arrived(request_id, num_prompt_tokens, arrival_s)

    def step(self, start_s: float, end_s: float, finish: dict[str, str] | None = None) -> StepStats:
        """Samples token 7 for every request that samples; `finish` gives the requests that stop, with the reason."""
        finish = finish or {}
        output = self.scheduler.schedule()
        sampling = [item.request for item in output.scheduled if item.samples_next_token]
        self.scheduler.update(output, [7] * len(sampling))
        for request in sampling:
            if request.request_id in finish:
                self.scheduler.finish(request, FinishReason(finish[request.request_id]))
        reasons = {request_id: FinishReason(reason) for request_id, reason in finish.items()}
        outputs = [CoreOutput(r.request_id, 7, None, reasons.get(r.request_id)) for r in sampling]
        self.tracker.stepped(StepResult(outputs, output), start_s, end_s)
        return self.tracker.collect(self.scheduler.stats())


def test_the_first_token_gives_time_to_first_token_and_counts_the_prompt():
    harness = Harness()
    harness.add("a", num_prompt_tokens=6, arrival_s=10.0)
    stats = harness.step(start_s=10.5, end_s=11.0)

    assert stats.time_to_first_token_s == [pytest.approx(1.0)]
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (6, 1)
    assert (stats.num_batched_requests, stats.num_batched_tokens) == (1, 6)
    assert (stats.num_running, stats.num_waiting) == (1, 0)
    assert stats.inter_token_latency_s == [] and stats.finish_reasons == [] and stats.completed == []


def test_later_tokens_give_inter_token_latencies_and_the_last_completes_the_request():
    harness = Harness()
    harness.add("a", num_prompt_tokens=6, arrival_s=10.0)
    harness.step(start_s=10.5, end_s=11.0)
    second = harness.step(start_s=11.0, end_s=11.25)
    last = harness.step(start_s=11.25, end_s=11.75, finish={"a": "length"})

    assert second.inter_token_latency_s == [pytest.approx(0.25)]
    assert (second.num_prompt_tokens, second.num_generation_tokens, second.num_batched_tokens) == (0, 1, 1)
    assert last.inter_token_latency_s == [pytest.approx(0.5)]
    assert last.finish_reasons == ["length"]
    [completed] = last.completed
    assert (completed.num_prompt_tokens, completed.num_generation_tokens) == (6, 3)
    assert completed.queue_time_s == pytest.approx(0.5)
    assert completed.prefill_time_s == pytest.approx(0.5)
    assert completed.decode_time_s == pytest.approx(0.75)
    assert completed.e2e_latency_s == pytest.approx(1.75)


def test_queue_time_ends_at_the_first_prefill_chunk_and_prefill_time_at_the_first_token():
    harness = Harness(max_num_batched_tokens=4)
    harness.add("a", num_prompt_tokens=10, arrival_s=0.0)
    chunks = [harness.step(start_s=1.0 + i, end_s=2.0 + i) for i in range(3)]  # 4 + 4 + 2 prompt tokens
    last = harness.step(start_s=4.0, end_s=5.0, finish={"a": "stop"})

    assert [stats.num_batched_tokens for stats in chunks] == [4, 4, 2]
    assert [stats.num_generation_tokens for stats in chunks] == [0, 0, 1]
    assert chunks[2].time_to_first_token_s == [pytest.approx(4.0)]
    [completed] = last.completed
    assert (completed.queue_time_s, completed.prefill_time_s, completed.decode_time_s) == pytest.approx((1, 3, 1))


def test_aborted_and_failed_requests_count_their_reason_once_and_no_timings():
    harness = Harness()
    harness.add("a", num_prompt_tokens=6, arrival_s=0.0)
    harness.add("b", num_prompt_tokens=6, arrival_s=0.0)
    harness.step(start_s=1.0, end_s=2.0)
    harness.tracker.finished("a", "abort")
    harness.tracker.finished("a", "abort")  # an abort racing the last token, or a second abort
    harness.tracker.finished("never-seen", "abort")
    harness.tracker.finished("b", "error")
    stats = harness.tracker.collect(harness.scheduler.stats())

    assert stats.finish_reasons == ["abort", "error"]
    assert stats.completed == []


def test_preemptions_and_preempted_waiting_requests_are_reported():
    harness = Harness(num_blocks=3)  # room for both 4-token prompts, not for both to grow
    harness.add("old", num_prompt_tokens=4, arrival_s=0.0)
    harness.add("new", num_prompt_tokens=4, arrival_s=0.0)
    harness.step(start_s=1.0, end_s=2.0)
    stats = harness.step(start_s=2.0, end_s=3.0)

    assert stats.num_preemptions == 1
    assert (stats.num_running, stats.num_waiting, stats.num_preempted_waiting) == (1, 1, 1)
    assert stats.kv_usage.num_used_blocks == 2
    assert harness.tracker.collect(harness.scheduler.stats()).num_preemptions == 0  # counted once


def test_prefix_cache_tokens_are_reported_as_what_changed_since_the_last_collect():
    harness = Harness()
    harness.add("first", num_prompt_tokens=9, arrival_s=0.0)
    first = harness.step(start_s=1.0, end_s=2.0, finish={"first": "length"})
    harness.add("again", num_prompt_tokens=9, arrival_s=2.0)
    again = harness.step(start_s=2.0, end_s=3.0)

    assert (first.prefix_cache_queried_tokens, first.prefix_cache_hit_tokens) == (9, 0)
    assert (again.prefix_cache_queried_tokens, again.prefix_cache_hit_tokens) == (9, 8)  # two full blocks
    assert again.num_batched_tokens == 1
    idle = harness.tracker.collect(harness.scheduler.stats())
    assert (idle.prefix_cache_queried_tokens, idle.prefix_cache_hit_tokens, idle.num_batched_requests) == (0, 0, 0)
