"""Chunked prefill: long prompts are computed over several steps under the token budget, beside decodes."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kvcache import BlockAllocator
from kvserve.scheduler import FinishReason, Request, RequestStatus, Scheduler, SchedulerConfig
from tests.test_scheduler import add_request, scheduled_tokens, step


def chunked_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 10, chunk: int | None = None):
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=budget, enable_chunked_prefill=True, max_prefill_chunk_tokens=chunk
    )
    return Scheduler(config, BlockAllocator(num_blocks), block_size)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding():
    scheduler = chunked_scheduler(budget=10)
    add_request(scheduler, "a", 3)
    add_request(scheduler, "b", 2)
    step(scheduler)  # both prefilled whole
    long = add_request(scheduler, "long", 25)
    chunks = []
    while len(long.output_token_ids) == 0:
        output = step(scheduler)
        tokens = scheduled_tokens(output)
        assert tokens["a"] == 1 and tokens["b"] == 1  # decodes go on in every step
        assert sum(tokens.values()) <= 10
        chunks.append(tokens["long"])
    assert chunks == [8, 8, 8, 1]
    assert long.num_computed_tokens == 25 and len(long.output_token_ids) == 1


def test_only_the_last_chunk_samples():
    scheduler = chunked_scheduler(budget=6)
    request = add_request(scheduler, "a", 14)
    samples = [item.samples_next_token for _ in range(3) for item in step(scheduler).scheduled]
    assert samples == [False, False, True]
    assert request.output_token_ids == [7]


def test_the_chunk_cap_limits_one_request_per_step_but_not_the_batch():
    scheduler = chunked_scheduler(budget=16, chunk=5)
    add_request(scheduler, "a", 12)
    add_request(scheduler, "b", 12)
    assert scheduled_tokens(step(scheduler)) == {"a": 5, "b": 5}


def test_a_decode_preempted_for_an_older_prefill_leaves_the_step():
    # 8 one-token blocks: "old" prefills 6 tokens in chunks of 4; "new" (2 tokens) is admitted beside it
    # and decodes first in the next step, then must give its blocks to "old"'s second chunk.
    scheduler = chunked_scheduler(num_blocks=8, block_size=1, budget=9, chunk=4)
    old = add_request(scheduler, "old", 6)
    new = add_request(scheduler, "new", 2)
    for filler in "abcde":
        add_request(scheduler, filler, 1)
    assert scheduled_tokens(step(scheduler)) == {"old": 4, "new": 2, "a": 1, "b": 1}
    for filler in "ab":
        scheduler.finish(scheduler.get(filler), FinishReason.LENGTH)
    output = step(scheduler)
    assert [request.request_id for request in output.preempted] == ["new"]
    assert scheduled_tokens(output) == {"old": 2}
    assert new.block_ids == [] and new.output_token_ids == [7]  # its decode did not run
    assert old.num_computed_tokens == 6 and old.output_token_ids == [7]


def test_without_chunking_a_prompt_over_the_remaining_budget_waits_whole():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, enable_chunked_prefill=False)
    scheduler = Scheduler(config, BlockAllocator(64), 4)
    add_request(scheduler, "a", 3)
    add_request(scheduler, "b", 9)
    assert scheduled_tokens(step(scheduler)) == {"a": 3}
    assert scheduled_tokens(step(scheduler)) == {"a": 1, "b": 9}


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 4),
    num_blocks=st.integers(8, 24),
    budget=st.integers(1, 12),
    chunk=st.none() | st.integers(1, 6),
    requests=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 6)), min_size=1, max_size=8),
)
def test_chunked_scheduling_respects_budgets_finishes_everything_and_frees_every_block(
    block_size, num_blocks, budget, chunk, requests
):
    scheduler = chunked_scheduler(num_blocks, block_size, budget, chunk)
    capacity = num_blocks * block_size
    targets = {}
    for i, (num_prompt, num_output) in enumerate(requests):
        num_prompt = min(num_prompt, capacity - num_output)  # the engine only admits what the pool can hold
        if num_prompt < 1:
            continue
        scheduler.add(Request(request_id=str(i), prompt_token_ids=[1] * num_prompt))
        targets[str(i)] = num_output
    for _ in range(2000):
        if not scheduler.num_unfinished:
            break
        output = scheduler.schedule()
        assert output.num_batched_tokens <= budget
        assert all(item.request.status is RequestStatus.RUNNING for item in output.scheduled)
        for item in output.scheduled:
            assert item.num_new_tokens <= (chunk or budget) or item.num_new_tokens == 1
        scheduler.update(output, [7 for item in output.scheduled if item.samples_next_token])
        held = [block for request in scheduler.running for block in request.block_ids]
        assert len(held) == len(set(held)) == scheduler.allocator.num_used_blocks
        for request in list(scheduler.running):
            assert len(request.block_ids) == -(-request.num_computed_tokens // block_size)
            if len(request.output_token_ids) == targets[request.request_id]:
                scheduler.finish(request, FinishReason.LENGTH)
    assert scheduler.num_unfinished == 0
    assert scheduler.allocator.num_used_blocks == 0
