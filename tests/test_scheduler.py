"""Scheduler: continuous batching under token and KV-block budgets, preemption by recompute, abort.

The tests drive the scheduler as the engine does, without a model: schedule a step, report one fake
sampled token per request that samples, finish requests that reached their length, abort some.
"""

from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings, target
from hypothesis import strategies as st

from kvserve.kvcache import BlockAllocator
from kvserve.scheduler import (
    FinishReason,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    priority_order,
)  # fmt: skip


def make_scheduler(
    num_blocks: int,
    block_size: int,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    watermark_blocks: int = 0,
    policy: str = "fcfs",
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        watermark_blocks=watermark_blocks,
        policy=policy,
    )
    return Scheduler(config, BlockAllocator(num_blocks), block_size)


def add_request(scheduler: Scheduler, request_id: str, num_prompt_tokens: int, priority: int = 0) -> Request:
    prompt_token_ids = list(range(100, 100 + num_prompt_tokens))
    request = Request(request_id=request_id, prompt_token_ids=prompt_token_ids, priority=priority)
    scheduler.add(request)
    return request


def ids(requests) -> list[str]:
    return [request.request_id for request in requests]


def step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule one step and record a sampled token (7) for every request that samples."""
    output = scheduler.schedule()
    scheduler.update(output, [7 for item in output.scheduled if item.samples_next_token])
    return output


def scheduled_tokens(output: SchedulerOutput) -> dict[str, int]:
    return {item.request.request_id: item.num_new_tokens for item in output.scheduled}


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# --- Specific behaviour ---------------------------------------------------------------------------------------------


def test_duplicate_request_id_is_rejected():
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    add_request(scheduler, "a", 2)
    step(scheduler)
    with pytest.raises(ValueError, match="already in use"):
        add_request(scheduler, "a", 1)
    assert scheduler.num_unfinished == 1
    assert [request.request_id for request in scheduler.waiting] == []


def test_prefill_and_decode_share_one_step():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    add_request(scheduler, "a", 5)
    assert scheduled_tokens(step(scheduler)) == {"a": 5}
    add_request(scheduler, "b", 3)
    output = step(scheduler)
    assert scheduled_tokens(output) == {"a": 1, "b": 3}
    assert output.num_batched_tokens == 4
    assert [len(request.output_token_ids) for request in scheduler.running] == [2, 1]


def test_every_scheduled_request_samples_because_the_whole_tail_is_computed():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    add_request(scheduler, "a", 5)
    output = scheduler.schedule()
    assert [(item.start_position, item.num_new_tokens, item.samples_next_token) for item in output.scheduled] == [
        (0, 5, True)
    ]


def test_running_requests_hold_blocks_for_exactly_their_computed_tokens():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    request = add_request(scheduler, "a", 4)
    step(scheduler)
    assert (request.num_computed_tokens, len(request.block_ids)) == (4, 1)
    step(scheduler)
    assert (request.num_computed_tokens, len(request.block_ids)) == (5, 2)
    assert scheduler.kv_usage().num_used_blocks == 2
    assert scheduler.kv_usage().num_live_tokens == 5


def test_growth_without_free_blocks_preempts_the_most_recently_admitted_request():
    # 4 blocks of 2 tokens. After the prefills: a (3 tokens, 2 blocks) fits its next token,
    # b (2 tokens, 1 block) needs a second block, c (1 token, 1 block) is the newest.
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    a = add_request(scheduler, "a", 3)
    b = add_request(scheduler, "b", 2)
    c = add_request(scheduler, "c", 1)
    assert scheduled_tokens(step(scheduler)) == {"a": 3, "b": 2, "c": 1}
    assert scheduler.allocator.num_free_blocks == 0
    c_blocks = list(c.block_ids)

    output = step(scheduler)

    assert output.preempted == [c]
    assert scheduled_tokens(output) == {"a": 1, "b": 1}
    assert c.status is RequestStatus.PREEMPTED
    assert c.block_ids == []
    assert c.num_computed_tokens == 0
    assert c.output_token_ids == [7]  # kept: recomputed later, not sampled again
    assert c.num_preemptions == 1
    assert scheduler.num_preemptions == 1
    assert scheduler.waiting.peek() is c
    assert scheduler.running == [a, b]
    assert set(c_blocks) <= set(b.block_ids)  # the freed block went to the request that grew
    assert all(scheduler.allocator.ref_count(block_id) == 1 for block_id in c_blocks)


def test_newest_request_that_cannot_grow_preempts_itself():
    scheduler = make_scheduler(num_blocks=2, block_size=2)
    a = add_request(scheduler, "a", 1)
    b = add_request(scheduler, "b", 2)
    step(scheduler)
    output = step(scheduler)
    assert output.preempted == [b]
    assert scheduled_tokens(output) == {"a": 1}
    assert scheduler.running == [a]
    assert list(scheduler.waiting) == [b]
    assert scheduler.allocator.num_used_blocks == len(a.block_ids) == 1


def test_several_preemptions_in_one_step_requeue_the_victims_in_admission_order():
    # One token per block, no block free after the prefills.
    scheduler = make_scheduler(num_blocks=4, block_size=1)
    a = add_request(scheduler, "a", 2)
    b = add_request(scheduler, "b", 1)
    c = add_request(scheduler, "c", 1)
    d = add_request(scheduler, "d", 1)
    step(scheduler)
    assert scheduler.running == [a, b, c] and list(scheduler.waiting) == [d]
    output = step(scheduler)
    # a's growth takes c's block; b's growth then finds none, and b, now the newest, preempts itself.
    assert output.preempted == [c, b]
    assert scheduler.running == [a]
    assert list(scheduler.waiting) == [b, c, d]


def test_no_request_is_admitted_in_a_step_with_a_preemption():
    # b holds 3 blocks; a's growth preempts it, leaving 2 blocks free: enough for d, which still waits.
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    a = add_request(scheduler, "a", 2)
    b = add_request(scheduler, "b", 5)
    step(scheduler)
    d = add_request(scheduler, "d", 1)
    output = step(scheduler)
    assert output.preempted == [b]
    assert scheduled_tokens(output) == {"a": 1}
    assert scheduler.allocator.num_free_blocks == 2
    assert list(scheduler.waiting) == [b, d]
    assert d.status is RequestStatus.WAITING
    assert scheduler.running == [a]


def test_preempted_request_recomputes_its_prompt_and_output_when_readmitted():
    scheduler = make_scheduler(num_blocks=2, block_size=2)
    a = add_request(scheduler, "a", 1)
    b = add_request(scheduler, "b", 2)
    step(scheduler)
    step(scheduler)  # b preempted itself
    scheduler.finish(a, FinishReason.LENGTH)
    output = scheduler.schedule()
    assert scheduled_tokens(output) == {"b": 3}
    assert output.scheduled[0].start_position == 0
    assert output.scheduled[0].samples_next_token
    scheduler.update(output, [7])
    assert b.status is RequestStatus.RUNNING
    assert b.output_token_ids == [7, 7]
    assert len(b.block_ids) == 2


def test_watermark_holds_back_admission_while_others_run():
    scheduler = make_scheduler(num_blocks=6, block_size=2, watermark_blocks=2)
    a = add_request(scheduler, "a", 2)
    step(scheduler)  # a: 1 block
    b = add_request(scheduler, "b", 6)  # 3 blocks; a grows to 2: 4 free - 3 < 2
    output = step(scheduler)
    assert scheduled_tokens(output) == {"a": 1}
    assert scheduler.running == [a]
    assert b.status is RequestStatus.WAITING
    assert scheduler.allocator.num_free_blocks == 4


def test_watermark_admits_when_exactly_the_watermark_stays_free():
    scheduler = make_scheduler(num_blocks=6, block_size=2, watermark_blocks=2)
    add_request(scheduler, "a", 2)
    step(scheduler)
    add_request(scheduler, "b", 4)  # 2 blocks: 4 free - 2 == 2
    assert scheduled_tokens(step(scheduler)) == {"a": 1, "b": 4}
    assert scheduler.allocator.num_free_blocks == 2


def test_idle_scheduler_admits_despite_the_watermark():
    scheduler = make_scheduler(num_blocks=4, block_size=2, watermark_blocks=3)
    a = add_request(scheduler, "a", 8)
    assert scheduled_tokens(step(scheduler)) == {"a": 8}
    assert a.status is RequestStatus.RUNNING
    assert scheduler.allocator.num_free_blocks == 0


def test_watermark_applies_to_the_second_admission_of_an_idle_step():
    scheduler = make_scheduler(num_blocks=4, block_size=2, watermark_blocks=2)
    add_request(scheduler, "a", 2)
    b = add_request(scheduler, "b", 4)
    assert scheduled_tokens(step(scheduler)) == {"a": 2}
    assert list(scheduler.waiting) == [b]


def test_prompt_longer_than_the_remaining_token_budget_waits_behind_decodes():
    scheduler = make_scheduler(num_blocks=16, block_size=2, max_num_batched_tokens=4)
    a = add_request(scheduler, "a", 3)
    step(scheduler)
    b = add_request(scheduler, "b", 4)
    c = add_request(scheduler, "c", 1)
    output = step(scheduler)
    assert scheduled_tokens(output) == {"a": 1}  # c would fit but must not overtake b
    assert list(scheduler.waiting) == [b, c]
    scheduler.finish(a, FinishReason.STOP)
    assert scheduled_tokens(step(scheduler)) == {"b": 4}


def test_running_requests_are_capped_at_max_num_seqs():
    scheduler = make_scheduler(num_blocks=16, block_size=2, max_num_seqs=2)
    for request_id in "abc":
        add_request(scheduler, request_id, 1)
    assert scheduled_tokens(step(scheduler)) == {"a": 1, "b": 1}
    assert [request.request_id for request in scheduler.waiting] == ["c"]
    scheduler.finish(scheduler.running[0], FinishReason.LENGTH)
    assert scheduled_tokens(step(scheduler)) == {"b": 1, "c": 1}


def test_finish_frees_blocks_and_forgets_the_request():
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    a = add_request(scheduler, "a", 3)
    step(scheduler)
    scheduler.finish(a, FinishReason.LENGTH)
    assert a.status is RequestStatus.FINISHED
    assert a.finish_reason is FinishReason.LENGTH
    assert a.block_ids == []
    assert scheduler.allocator.num_free_blocks == 4
    assert scheduler.get("a") is None
    assert scheduler.num_unfinished == 0
    assert scheduler.running == []
    assert step(scheduler).is_empty


def test_finishing_a_finished_request_again_changes_nothing():
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    a = add_request(scheduler, "a", 3)
    step(scheduler)
    scheduler.finish(a, FinishReason.STOP)
    scheduler.finish(a, FinishReason.ABORT)
    assert a.finish_reason is FinishReason.STOP
    assert scheduler.allocator.num_free_blocks == 4


def test_abort_of_a_waiting_request_removes_it_from_the_queue():
    scheduler = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=1)
    add_request(scheduler, "a", 1)
    b = add_request(scheduler, "b", 1)
    step(scheduler)
    assert scheduler.abort("b") is b
    assert b.status is RequestStatus.FINISHED
    assert b.finish_reason is FinishReason.ABORT
    assert list(scheduler.waiting) == []
    assert scheduler.num_unfinished == 1


def test_abort_of_a_running_request_frees_its_blocks_at_once():
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    a = add_request(scheduler, "a", 3)
    b = add_request(scheduler, "b", 1)
    step(scheduler)
    assert scheduler.allocator.num_used_blocks == 3
    assert scheduler.abort("a") is a
    assert a.finish_reason is FinishReason.ABORT
    assert a.block_ids == []
    assert scheduler.running == [b]
    assert scheduler.allocator.num_used_blocks == len(b.block_ids) == 1
    assert scheduler.kv_usage().num_live_tokens == b.num_computed_tokens


def test_abort_of_a_preempted_request_removes_it_from_the_front_of_the_queue():
    scheduler = make_scheduler(num_blocks=2, block_size=2)
    add_request(scheduler, "a", 1)
    b = add_request(scheduler, "b", 2)
    step(scheduler)
    step(scheduler)
    assert b.status is RequestStatus.PREEMPTED
    assert scheduler.abort("b") is b
    assert b.finish_reason is FinishReason.ABORT
    assert list(scheduler.waiting) == []
    assert scheduler.allocator.num_used_blocks == 1


def test_abort_of_an_unknown_or_finished_request_returns_none():
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    add_request(scheduler, "a", 1)
    assert scheduler.abort("nope") is None
    scheduler.abort("a")
    assert scheduler.abort("a") is None


# --- Priority scheduling --------------------------------------------------------------------------------------------


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler = make_scheduler(num_blocks=16, block_size=2, max_num_seqs=1, policy="priority")
    for request_id, priority in [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", -1)]:
        add_request(scheduler, request_id, 1, priority)
    assert ids(scheduler.waiting) == ["e", "b", "d", "c", "a"]
    admitted = []
    while scheduler.num_unfinished:
        step(scheduler)
        running = scheduler.running[0]
        admitted.append(running.request_id)
        scheduler.finish(running, FinishReason.LENGTH)
    assert admitted == ["e", "b", "d", "c", "a"]


def test_fcfs_policy_admits_in_arrival_order_whatever_the_priority():
    scheduler = make_scheduler(num_blocks=16, block_size=2, max_num_seqs=1)
    for request_id, priority in [("a", 2), ("b", 0), ("c", 1)]:
        add_request(scheduler, request_id, 1, priority)
    assert ids(scheduler.waiting) == ["a", "b", "c"]


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "c"), ("priority", "a")])
def test_growth_without_free_blocks_preempts_the_newest_or_the_lowest_priority_request(policy, victim):
    # As in the test above: b needs a second block and none is free. a is the oldest but of the lowest priority.
    scheduler = make_scheduler(num_blocks=4, block_size=2, policy=policy)
    a = add_request(scheduler, "a", 3, priority=5)
    b = add_request(scheduler, "b", 2)
    c = add_request(scheduler, "c", 1)
    step(scheduler)
    preempted = scheduler.get(victim)
    victim_blocks = list(preempted.block_ids)

    output = step(scheduler)

    assert output.preempted == [preempted]
    survivors = [request for request in (a, b, c) if request is not preempted]
    assert scheduled_tokens(output) == {request.request_id: 1 for request in survivors}
    assert preempted.status is RequestStatus.PREEMPTED and preempted.block_ids == []
    assert scheduler.running == survivors
    assert set(victim_blocks) & set(b.block_ids)  # the freed block went to the request that grew


def test_among_equal_priorities_the_latest_arrival_is_preempted_first():
    scheduler = make_scheduler(num_blocks=4, block_size=1, policy="priority")
    a = add_request(scheduler, "a", 2, priority=1)
    b = add_request(scheduler, "b", 1, priority=1)
    c = add_request(scheduler, "c", 1)
    step(scheduler)  # no block left; each needs one more
    output = step(scheduler)
    # a's growth takes b's block (b: priority 1, after a); c's growth then takes a's, the last of priority 1.
    assert output.preempted == [b, a]
    assert scheduler.running == [c]
    assert list(scheduler.waiting) == [a, b]


def test_a_waiting_request_of_higher_priority_preempts_the_lowest_running_one():
    scheduler = make_scheduler(num_blocks=16, block_size=2, max_num_seqs=2, policy="priority")
    a = add_request(scheduler, "a", 2, priority=1)
    b = add_request(scheduler, "b", 2, priority=3)
    step(scheduler)
    c = add_request(scheduler, "c", 3, priority=0)

    output = step(scheduler)

    assert output.preempted == [b]
    assert scheduled_tokens(output) == {"a": 1, "c": 3}  # b's decode, scheduled first, left the step
    assert scheduler.running == [a, c]
    assert list(scheduler.waiting) == [b]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.output_token_ids == [7]
    assert scheduler.allocator.num_used_blocks == len(a.block_ids) + len(c.block_ids)


def test_a_waiting_request_preempts_as_few_lower_requests_as_let_it_in():
    # Four blocks free; c needs six, so the two lowest (d, then b) go, and a, also lower than c, stays.
    scheduler = make_scheduler(num_blocks=8, block_size=2, policy="priority")
    a = add_request(scheduler, "a", 3, priority=1)
    b = add_request(scheduler, "b", 1, priority=2)
    d = add_request(scheduler, "d", 1, priority=3)
    step(scheduler)  # a: 2 blocks, b: 1, d: 1
    c = add_request(scheduler, "c", 11, priority=0)  # 6 blocks

    output = step(scheduler)

    assert output.preempted == [d, b]
    assert scheduled_tokens(output) == {"a": 1, "c": 11}
    assert scheduler.running == [a, c] and list(scheduler.waiting) == [b, d]
    assert scheduler.allocator.num_free_blocks == 0


@pytest.mark.parametrize(("policy", "priority"), [("priority", 0), ("priority", 1), ("fcfs", -5)])
def test_a_waiting_request_preempts_no_request_of_its_own_or_a_higher_priority_nor_under_fcfs(policy, priority):
    scheduler = make_scheduler(num_blocks=16, block_size=2, max_num_seqs=2, policy=policy)
    add_request(scheduler, "a", 2, priority=0)
    add_request(scheduler, "b", 2, priority=0)
    step(scheduler)
    c = add_request(scheduler, "c", 2, priority=priority)
    output = step(scheduler)
    assert output.preempted == [] and scheduled_tokens(output) == {"a": 1, "b": 1}
    assert list(scheduler.waiting) == [c]


def test_nothing_is_preempted_for_a_request_that_would_not_fit_even_then():
    # c needs 3 blocks; preempting b (lower) frees 1 and a (equal) keeps 2 of the 4: c waits and b keeps running.
    scheduler = make_scheduler(num_blocks=4, block_size=2, policy="priority")
    add_request(scheduler, "a", 3, priority=0)
    add_request(scheduler, "b", 1, priority=5)
    step(scheduler)
    c = add_request(scheduler, "c", 6, priority=0)
    output = step(scheduler)
    assert output.preempted == [] and scheduled_tokens(output) == {"a": 1, "b": 1}
    assert list(scheduler.waiting) == [c] and scheduler.num_preemptions == 0


def test_a_request_preempted_for_another_is_not_readmitted_in_the_same_step():
    # c takes the one seat b held; b would fit the blocks left, but only to compute again what it just lost.
    scheduler = make_scheduler(num_blocks=16, block_size=2, max_num_seqs=2, policy="priority")
    add_request(scheduler, "a", 2, priority=1)
    b = add_request(scheduler, "b", 2, priority=3)
    step(scheduler)
    add_request(scheduler, "c", 2, priority=0)
    assert step(scheduler).preempted == [b]
    scheduler.finish(scheduler.get("a"), FinishReason.STOP)
    assert scheduled_tokens(step(scheduler)) == {"c": 1, "b": 3}  # readmitted next step, prompt and token again


def test_a_request_admitted_by_preemption_reuses_the_victims_cached_prefix():
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, enable_prefix_caching=True, policy="priority")
    scheduler = Scheduler(config, BlockAllocator(4), 2)
    low = Request("low", [1, 2, 3, 4, 5], priority=5)
    scheduler.add(low)
    step(scheduler)  # 3 blocks, the first two full and cached; one block free
    prefix_blocks = low.block_ids[:2]
    high = Request("high", [1, 2, 3, 4, 9, 9], priority=0)
    scheduler.add(high)

    output = step(scheduler)

    # Its 3 blocks: the 2 cached ones low held (free once low is preempted) and 1 new: more than the 1 free block.
    assert output.preempted == [low]
    assert scheduled_tokens(output) == {"high": 2}
    assert high.block_ids[:2] == prefix_blocks and high.num_computed_tokens == 6
    assert scheduler.prefix_cache_hit_tokens == 4


# --- Random workloads -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedRequest:
    num_prompt_tokens: int
    num_output_tokens: int  # finished with LENGTH after this many sampled tokens
    arrival_step: int
    abort_delay: int | None  # steps after arrival to abort it, whatever state it is in
    priority: int  # used under the priority policy


@dataclass(frozen=True)
class Workload:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    watermark_blocks: int
    requests: list[PlannedRequest]
    policy: str


@st.composite
def planned_requests(draw, max_request_tokens: int) -> PlannedRequest:
    num_tokens = draw(st.integers(2, max_request_tokens))
    num_prompt_tokens = draw(st.integers(1, num_tokens - 1))
    return PlannedRequest(
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_tokens - num_prompt_tokens,
        arrival_step=draw(st.integers(0, 6)),
        abort_delay=draw(st.none() | st.integers(0, 20)),
        priority=draw(st.integers(-1, 2)),
    )


@st.composite
def workloads(draw, policy: str) -> Workload:
    # Small pools and overlapping requests, so that requests often have to be preempted.
    block_size = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(2 if block_size == 1 else 1, 10))
    max_num_batched_tokens = draw(st.integers(2, 32))
    # The engine refuses a request whose prompt plus max_tokens exceeds the pool or the token budget.
    max_request_tokens = min(num_blocks * block_size, max_num_batched_tokens)
    return Workload(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=max_num_batched_tokens,
        watermark_blocks=draw(st.just(0) | st.integers(0, num_blocks)),
        requests=draw(st.lists(planned_requests(max_request_tokens), min_size=1, max_size=10)),
        policy=policy,
    )


class Simulation:
    """The engine loop over a planned workload, checking the scheduler after every step."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.scheduler = make_scheduler(
            workload.num_blocks,
            workload.block_size,
            workload.max_num_seqs,
            workload.max_num_batched_tokens,
            workload.watermark_blocks,
            workload.policy,
        )
        self.requests: list[Request] = []
        self.arrival_rank: dict[int, int] = {}  # request index -> position in the order of add()
        self.first_started: list[int] = []  # arrival ranks, in the order requests first ran

    def index(self, request: Request) -> int:
        return int(request.request_id)

    def fake_token(self, request: Request) -> int:
        # Encodes owner and position, so a token routed to the wrong request or lost is visible.
        return 1000 * self.index(request) + len(request.output_token_ids)

    def run(self) -> None:
        plan = self.workload.requests
        # Liveness bound: the first running request in the policy's order is never preempted (the pool holds any
        # single request), a waiting request preempts only to be admitted, and an idle scheduler admits the head
        # of the queue; so once all have arrived, every step gains a token that is kept, and there are only so
        # many tokens to sample.
        max_num_steps = max(p.arrival_step for p in plan) + sum(p.num_output_tokens for p in plan) + 1
        for step_index in range(max_num_steps + 1):
            self.add_arrivals(step_index)
            if len(self.requests) == len(plan) and self.scheduler.num_unfinished == 0:
                break
            self.run_step()
            self.abort_planned(step_index)
            self.check_state()
        else:
            pytest.fail(f"requests still unfinished after {max_num_steps} steps")
        self.check_all_finished()
        target(float(self.scheduler.num_preemptions), label="preemptions")

    def add_arrivals(self, step_index: int) -> None:
        for index, planned in enumerate(self.workload.requests):
            if planned.arrival_step != step_index:
                continue
            prompt_token_ids = [index] * planned.num_prompt_tokens
            request = Request(request_id=str(index), prompt_token_ids=prompt_token_ids, priority=planned.priority)
            self.scheduler.add(request)
            self.requests.append(request)
            self.arrival_rank[index] = len(self.arrival_rank)
            waiting = list(self.scheduler.waiting)
            if self.workload.policy == "fcfs":
                assert waiting[-1] is request
            else:
                assert waiting == sorted(waiting, key=priority_order)

    def run_step(self) -> None:
        scheduler = self.scheduler
        running_before = list(scheduler.running)
        waiting_before = list(scheduler.waiting)
        output = scheduler.schedule()
        self.check_schedule(output, running_before, waiting_before)
        sampled_token_ids = [self.fake_token(item.request) for item in output.scheduled if item.samples_next_token]
        scheduler.update(output, sampled_token_ids)
        for item in output.scheduled:
            request = item.request
            if len(request.output_token_ids) == self.workload.requests[self.index(request)].num_output_tokens:
                scheduler.finish(request, FinishReason.LENGTH)

    def check_schedule(self, output: SchedulerOutput, running_before: list[Request], waiting_before: list[Request]):
        scheduler, config, block_size = self.scheduler, self.scheduler.config, self.scheduler.block_size
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(scheduler.running) <= config.max_num_seqs

        preempted = output.preempted
        if preempted:
            event("preemption")
        for request in preempted:
            assert request.status is RequestStatus.PREEMPTED
            assert request.block_ids == []
            assert request.num_computed_tokens == 0
        survivors = [request for request in running_before if request not in preempted]
        continuing = [item for item in output.scheduled if item.request in survivors]
        admitted = [item.request for item in output.scheduled if item.request not in survivors]
        assert output.scheduled[: len(continuing)] == continuing, "running requests come before admitted ones"
        assert scheduler.running == survivors + admitted
        if config.policy == "fcfs":
            self.check_fcfs_order(preempted, admitted, running_before, waiting_before)
        else:
            self.check_priority_order(preempted, admitted, survivors, waiting_before)

        # Running requests are served oldest first; one is skipped only when its tokens exceed what is left (what
        # requests before it took, victims included: one scheduled before its preemption gave its token back late).
        budget = config.max_num_batched_tokens
        scheduled_ids = {id(item.request) for item in continuing}
        for request in running_before:
            if request in preempted or id(request) in scheduled_ids:
                budget -= request.num_uncomputed_tokens if id(request) in scheduled_ids else 1
            else:
                assert request.num_uncomputed_tokens > budget
        budget = config.max_num_batched_tokens - sum(item.num_new_tokens for item in continuing)
        for item in continuing:
            assert item.num_new_tokens == item.request.num_uncomputed_tokens == 1
        for item in output.scheduled[len(continuing) :]:
            assert item.start_position == 0
            assert item.num_new_tokens == item.request.num_tokens
            budget -= item.num_new_tokens
        assert budget >= 0

        for item in output.scheduled:
            assert item.samples_next_token
            num_tokens_after = item.start_position + item.num_new_tokens
            assert len(item.request.block_ids) == num_blocks_for(num_tokens_after, block_size)

        num_free = scheduler.allocator.num_free_blocks
        if admitted and (survivors or len(admitted) > 1):
            assert num_free >= config.watermark_blocks, "admission beside running requests keeps the watermark"

        # Admission stops only for a reason: no queue, a preemption while running requests grew, the head was just
        # preempted, or it does not fit (under priority: not even if every lower running request were preempted).
        admission_ran = not preempted or (config.policy == "priority" and admitted)
        if scheduler.waiting and admission_ran and scheduler.waiting.peek() not in preempted:
            head = scheduler.waiting.peek()
            lower = [r for r in scheduler.running if config.policy == "priority" and r.priority > head.priority]
            assert not self.fits(head, scheduler.running, budget), "the head of the queue fits"
            assert not self.fits(head, [r for r in scheduler.running if r not in lower], budget, lower)

    def fits(self, head: Request, running: list[Request], budget: int, victims: list[Request] = ()) -> bool:
        """Whether `head` could be admitted beside `running`, once `victims` gave back their blocks (no block is
        shared here: the workloads have no prefix cache)."""
        scheduler, config = self.scheduler, self.scheduler.config
        num_free = scheduler.allocator.num_free_blocks + sum(len(victim.block_ids) for victim in victims)
        watermark = config.watermark_blocks if running else 0
        seat = len(running) < config.max_num_seqs
        blocks = num_free - num_blocks_for(head.num_tokens, scheduler.block_size) >= watermark
        return seat and head.num_tokens <= budget and blocks

    def check_fcfs_order(self, preempted, admitted, running_before, waiting_before) -> None:
        # Preemption takes the most recently admitted requests, newest first, and puts them back in front.
        assert preempted == running_before[::-1][: len(preempted)]
        queue = preempted[::-1] + waiting_before
        assert admitted == queue[: len(admitted)], "admission is first come, first served"
        assert not (preempted and admitted), "a step that preempts admits nothing"
        assert list(self.scheduler.waiting) == queue[len(admitted) :]
        for request in admitted:
            rank = self.arrival_rank[self.index(request)]
            if rank not in self.first_started:
                assert all(earlier < rank for earlier in self.first_started), "requests first run in arrival order"
                self.first_started.append(rank)

    def check_priority_order(self, preempted, admitted, survivors, waiting_before) -> None:
        # Preemption takes the lowest requests (largest priority value, latest arrival), lowest first; the queue
        # stays in (priority, arrival) order, and admission takes its head.
        assert preempted == sorted(preempted, key=priority_order, reverse=True)
        assert all(priority_order(victim) > priority_order(r) for victim in preempted for r in survivors)
        queue = sorted(waiting_before + preempted, key=priority_order)
        assert admitted == queue[: len(admitted)], "admission is by (priority, arrival)"
        assert list(self.scheduler.waiting) == queue[len(admitted) :]
        if preempted and admitted:  # preempted for admission: only by requests of a smaller priority value
            event("preemption for a higher priority")
            assert max(victim.priority for victim in preempted) > min(request.priority for request in admitted)
            assert max(map(priority_order, admitted)) < min(map(priority_order, preempted))

    def abort_planned(self, step_index: int) -> None:
        for request in self.requests:
            planned = self.workload.requests[self.index(request)]
            if planned.abort_delay is None or planned.arrival_step + planned.abort_delay != step_index:
                continue
            was_finished = request.is_finished
            event(f"abort of a {request.status.value} request")
            num_used_before = self.scheduler.allocator.num_used_blocks
            num_held = len(request.block_ids)
            aborted = self.scheduler.abort(request.request_id)
            if was_finished:
                assert aborted is None
                assert self.scheduler.allocator.num_used_blocks == num_used_before
            else:
                assert aborted is request
                assert request.finish_reason is FinishReason.ABORT
                assert self.scheduler.allocator.num_used_blocks == num_used_before - num_held

    def check_state(self) -> None:
        scheduler, config, block_size = self.scheduler, self.scheduler.config, self.scheduler.block_size
        allocator = scheduler.allocator
        assert len(scheduler.running) <= config.max_num_seqs

        held_block_ids = [block_id for request in scheduler.running for block_id in request.block_ids]
        assert len(set(held_block_ids)) == len(held_block_ids), "a block is held by two requests"
        assert allocator.num_used_blocks == len(held_block_ids)
        assert all(allocator.ref_count(block_id) == 1 for block_id in held_block_ids)
        for request in scheduler.running:
            assert request.status is RequestStatus.RUNNING
            assert request.num_uncomputed_tokens == 1  # just the token sampled last
            assert len(request.block_ids) == num_blocks_for(request.num_computed_tokens, block_size)
        for request in scheduler.waiting:
            assert request.status is (RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING)
            assert request.block_ids == []
            assert request.num_computed_tokens == 0

        queued = scheduler.running + list(scheduler.waiting)
        assert len({id(request) for request in queued}) == len(queued) == scheduler.num_unfinished
        for request in self.requests:
            assert (scheduler.get(request.request_id) is request) == (not request.is_finished)
            assert request.output_token_ids == [
                1000 * self.index(request) + k for k in range(len(request.output_token_ids))
            ]
            assert len(request.output_token_ids) <= self.workload.requests[self.index(request)].num_output_tokens
            if request.is_finished:
                assert request.block_ids == []
                assert request.finish_reason in (FinishReason.LENGTH, FinishReason.ABORT)

        usage = scheduler.kv_usage()
        assert usage.num_used_blocks == allocator.num_used_blocks
        assert usage.num_live_tokens == sum(request.num_computed_tokens for request in scheduler.running)
        assert usage.num_live_tokens <= usage.num_used_blocks * block_size

    def check_all_finished(self) -> None:
        scheduler = self.scheduler
        assert len(self.requests) == len(self.workload.requests)
        assert scheduler.running == [] and list(scheduler.waiting) == []
        assert scheduler.num_unfinished == 0
        for request in self.requests:
            planned = self.workload.requests[self.index(request)]
            assert request.is_finished
            if request.finish_reason is FinishReason.LENGTH:
                assert len(request.output_token_ids) == planned.num_output_tokens
            else:
                assert planned.abort_delay is not None
        assert self.first_started == sorted(self.first_started)
        assert scheduler.allocator.num_free_blocks == scheduler.allocator.num_blocks
        assert scheduler.kv_usage().num_used_blocks == 0


@settings(max_examples=300, deadline=None)
@given(workload=workloads("fcfs"))
def test_scheduler_keeps_its_invariants_and_finishes_every_request(workload):
    Simulation(workload).run()


@settings(max_examples=300, deadline=None)
@given(workload=workloads("priority"))
def test_priority_scheduler_keeps_its_invariants_and_finishes_every_request(workload):
    Simulation(workload).run()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_requests_of_more_adapters_than_max_loras_wait_and_later_ones_pass_them(policy):
    """Two adapters at a time: a request of a third waits, in its place, while later requests of running adapters (or
    the base model) are admitted; it runs once an adapter's requests are gone."""
    from kvserve.kvcache import AdapterTag

    scheduler = Scheduler(SchedulerConfig(max_loras=2, policy=policy), BlockAllocator(64), 16)
    tags = {name: AdapterTag(index, name, f"/adapters/{name}") for index, name in enumerate("abc")}
    lora_of = {"r0": "a", "r1": "b", "r2": "c", "r3": "a", "r4": None, "r5": "c"}
    requests = {}
    for request_id, name in lora_of.items():
        requests[request_id] = Request(request_id, [1, 2, 3], lora=tags.get(name))
        scheduler.add(requests[request_id])
    first = step(scheduler)
    assert [item.request.request_id for item in first.scheduled] == ["r0", "r1", "r3", "r4"]
    assert [request.request_id for request in scheduler.waiting] == ["r2", "r5"]  # still in order
    scheduler.finish(requests["r1"], FinishReason.STOP)
    second = step(scheduler)
    assert {item.request.request_id for item in second.scheduled} >= {"r2", "r5"}
    adapters = {request.lora for request in scheduler.running if request.lora is not None}
    assert adapters == {tags["a"], tags["c"]}


def test_a_higher_priority_request_of_another_adapter_preempts_nothing_for_an_adapter_slot():
    """A request waiting for an adapter slot is passed over before it could preempt: whatever its priority, it waits
    for the running requests of an adapter to finish (preemption makes room in seats, blocks and tokens only)."""
    from kvserve.kvcache import AdapterTag

    scheduler = Scheduler(SchedulerConfig(max_loras=2, max_num_seqs=2, policy="priority"), BlockAllocator(64), 16)
    tags = [AdapterTag(index, name, f"/adapters/{name}") for index, name in enumerate("abc")]
    for index, tag in enumerate(tags[:2]):
        scheduler.add(Request(f"r{index}", [1, 2, 3], lora=tag, priority=5))
    step(scheduler)
    scheduler.add(Request("urgent", [1, 2, 3], lora=tags[2], priority=0))
    output = step(scheduler)
    assert output.preempted == [] and ids(scheduler.running) == ["r0", "r1"] and ids(scheduler.waiting) == ["urgent"]
