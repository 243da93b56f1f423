"""Continuous batching: admission under KV-block and token budgets, preemption by recompute.

Every step schedules "N new tokens per request" in one batch: a request's uncomputed tail (the
prompt on first run, everything again after a preemption; in chunks under the token budget when
chunked prefill is on) or, when decoding, its one last sampled token, and after it as many of its draft
tokens (speculative decoding) as fit without preempting anyone. Decoding requests are served
first, then unfinished prefills, each oldest first; when one cannot grow, a running request is
preempted (its blocks freed, put back in the queue): under the `fcfs` policy the most recently
admitted one, under `priority` the one of the largest priority value (the latest arrival among equals).
Waiting requests are admitted in the queue's order (scheduler/request_queue.py), none in a step that
had to preempt. Under `priority` only, a waiting request that does not fit (no seat, blocks or tokens
left) preempts the fewest running requests of a larger priority value, lowest first, that let it in,
as vLLM's priority scheduler (v0) did; none if even all of them would not (nothing is preempted in
vain), and never one of its own priority, which would only trade places with it. A request passed
over for a LoRA adapter slot preempts nothing.
"""

from collections import Counter
from dataclasses import dataclass, field
from itertools import count

from kvserve.kvcache import BlockAllocator, BlockHasher, KVUsage, block_extra_keys
from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.request import FinishReason, Request, RequestStatus
from kvserve.scheduler.request_queue import WaitingQueue, priority_order, waiting_queue
from kvserve.scheduler.scheduler_output import (
    LoraRequestCounts,
    PriorityRequestCounts,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int) -> None:
        self.config = config
        self.allocator = allocator
        self.block_size = block_size
        self.hasher = BlockHasher(config.block_hash_seed)
        self.waiting: WaitingQueue = waiting_queue(config.policy)
        self._arrival_indices = count()
        self.running: list[Request] = []  # in admission order, oldest first
        self._requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self._left_running: list[str] = []  # since the last schedule()

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._requests[request.request_id] = request
        request.arrival_index = next(self._arrival_indices)
        self.waiting.add(request)

    def schedule(self) -> SchedulerOutput:
        token_budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, ScheduledRequest] = {}
        preempted: list[Request] = []
        prefilling, block_size = [], self.block_size
        for request in list(self.running):  # decodes first, oldest first; prefills after them
            computed = request.num_computed_tokens
            if len(request.prompt_token_ids) + len(request.output_token_ids) - computed != 1:
                prefilling.append(request)
            elif token_budget and computed < len(request.block_ids) * block_size:
                # The common case, kept short (every decoding request, every step): one token into the room left
                # in its last block.
                if request.draft_token_ids:
                    token_budget = self._schedule_with_drafts(request, token_budget, scheduled)
                else:
                    scheduled[request] = ScheduledRequest(request, 1, computed, True)
                    token_budget -= 1
            elif request.status is RequestStatus.RUNNING:  # not preempted earlier in this loop
                token_budget = self._schedule_growing(request, token_budget, scheduled, preempted)
        for request in prefilling:
            if request.status is RequestStatus.RUNNING:
                token_budget = self._schedule_growing(request, token_budget, scheduled, preempted)
        if not preempted:
            self._admit_waiting(token_budget, scheduled, preempted)
        left_running, self._left_running = self._left_running, []
        return SchedulerOutput(scheduled=list(scheduled.values()), preempted=preempted, left_running=left_running)

    def _schedule_growing(
        self, request: Request, token_budget: int, scheduled: dict[Request, ScheduledRequest], preempted: list[Request]
    ) -> int:
        """Schedule what of `request` fits the budget, preempting the lowest running requests if it needs blocks
        that are not free; the budget left."""
        num_new_tokens = self._num_tokens_to_run(request.num_uncomputed_tokens, token_budget)
        if not num_new_tokens:
            return token_budget
        num_preempted_before = len(preempted)
        granted = self._grow_or_preempt(request, num_new_tokens, preempted)
        for victim in preempted[num_preempted_before:]:
            token_budget += _unschedule(victim, scheduled)
        if granted:
            scheduled[request] = ScheduledRequest.of(request, num_new_tokens)
            token_budget -= num_new_tokens
        return token_budget

    def _schedule_with_drafts(
        self, request: Request, token_budget: int, scheduled: dict[Request, ScheduledRequest]
    ) -> int:
        """A decode with as many of its draft tokens as the budget and blocks allow: the room left in its last block,
        then free blocks above the watermark. Drafts never preempt anyone: they are a guess. The budget left."""
        computed, block_size = request.num_computed_tokens, self.block_size
        num_drafts = min(len(request.draft_token_ids), token_budget - 1)
        room = len(request.block_ids) * block_size - computed - 1
        if num_drafts > room:
            spare_blocks = max(0, self.allocator.num_free_blocks - self.config.watermark_blocks)
            num_blocks = min(-(-(num_drafts - room) // block_size), spare_blocks)
            request.block_ids.extend(self.allocator.allocate(num_blocks))
            num_drafts = min(num_drafts, room + num_blocks * block_size)
        scheduled[request] = ScheduledRequest(request, 1 + num_drafts, computed, True, num_drafts)
        return token_budget - 1 - num_drafts

    def update(
        self, output: SchedulerOutput, sampled_token_ids: list[int], num_accepted_drafts: list[int] | None = None
    ) -> None:
        """Record a finished step: computed tokens advance, sampling requests get their token.

        `sampled_token_ids` holds one id per scheduled request that samples, in schedule order; `num_accepted_drafts`
        one count per request scheduled with draft tokens, in schedule order: its first drafts that verification
        accepted, which join its output before the sampled token. The rejected ones' KV lies past its computed
        tokens, where its next tokens overwrite it; a block given for drafts stays the request's, for those tokens
        (freeing it would leave the planner's table row pointing at a block another request may take).
        """
        sampled = iter(sampled_token_ids)
        accepted = iter(num_accepted_drafts or ())
        caching, block_size = self.config.enable_prefix_caching, self.block_size
        for item in output.scheduled:
            request = item.request
            if item.num_draft_tokens:
                num_accepted = next(accepted)
                request.num_computed_tokens += 1 + num_accepted
                request.output_token_ids += request.draft_token_ids[:num_accepted]
            else:
                request.num_computed_tokens += item.num_new_tokens
            if item.samples_next_token:
                request.output_token_ids.append(next(sampled))
            # Checked here, not in a call per request: a block fills only every block_size tokens.
            full_blocks = request.num_computed_tokens // block_size
            if caching and request.caches_blocks and full_blocks > request.num_registered_blocks:
                self._register_full_blocks(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Take a request out of the queues, wherever it is, and free its blocks at once."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._left_running.append(request.request_id)
        else:
            self.waiting.remove(request)
        self._release_blocks(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]

    def recompute(self, request: Request) -> None:
        """Put a running request back at the front of the queue to compute all its tokens again, in new
        blocks (its old ones stay cached for others)."""
        self.running.remove(request)
        self._left_running.append(request.request_id)
        self._release_blocks(request)
        request.status = RequestStatus.WAITING
        self.waiting.put_back(request)

    def abort(self, request_id: str) -> Request | None:
        request = self._requests.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORT)
        return request

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted_waiting=sum(request.status is RequestStatus.PREEMPTED for request in self.waiting),
            kv_usage=self.kv_usage(),
            prefix_cache_queried_tokens=self.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=self.prefix_cache_hit_tokens,
            lora_requests=self._lora_requests() if self.config.max_loras else None,
            priority_requests=self._priority_requests() if self.config.policy == "priority" else None,
        )

    def _priority_requests(self) -> PriorityRequestCounts:
        def per_priority(requests) -> dict[int, int]:
            return dict(sorted(Counter(request.priority for request in requests).items()))

        return PriorityRequestCounts(per_priority(self.running), per_priority(self.waiting))

    def _lora_requests(self) -> LoraRequestCounts:
        def per_adapter(requests) -> dict[str, int]:
            return dict(sorted(Counter(r.lora.name for r in requests if r.lora is not None).items()))

        return LoraRequestCounts(self.config.max_loras, per_adapter(self.running), per_adapter(self.waiting))

    def kv_usage(self) -> KVUsage:
        return KVUsage(
            num_total_blocks=self.allocator.num_blocks,
            num_used_blocks=self.allocator.num_used_blocks,
            num_live_tokens=sum(request.num_computed_tokens for request in self.running),
            block_size=self.block_size,
        )

    def _num_tokens_to_run(self, num_tokens: int, token_budget: int) -> int:
        """How many of a request's `num_tokens` uncomputed tokens fit this step; 0 if it must wait."""
        if not self.config.enable_chunked_prefill:
            return num_tokens if num_tokens <= token_budget else 0
        chunk_limit = self.config.max_prefill_chunk_tokens or token_budget
        return min(num_tokens, token_budget, chunk_limit)

    def _num_blocks_to_add(self, request: Request, num_new_tokens: int) -> int:
        num_tokens_after = request.num_computed_tokens + num_new_tokens
        return -(-num_tokens_after // self.block_size) - len(request.block_ids)

    def _grow_or_preempt(self, request: Request, num_new_tokens: int, preempted: list[Request]) -> bool:
        """Give `request` the blocks its new tokens need, preempting the lowest running requests if needed.

        Returns False when `request` itself had to be preempted.
        """
        num_blocks = self._num_blocks_to_add(request, num_new_tokens)
        while self.allocator.num_free_blocks < num_blocks:
            victim = self._lowest_running()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        request.block_ids.extend(self.allocator.allocate(num_blocks))
        return True

    def _admit_waiting(
        self, token_budget: int, scheduled: dict[Request, ScheduledRequest], preempted: list[Request]
    ) -> None:
        passed_over: list[Request] = []  # waiting for a free adapter slot, kept in their places
        try:
            self._admit_in_order(token_budget, scheduled, preempted, passed_over)
        finally:
            self.waiting.put_back_all(passed_over)

    def _admit_in_order(
        self, token_budget: int, scheduled: dict[Request, ScheduledRequest], preempted: list[Request],
        passed_over: list[Request],
    ) -> None:  # fmt: skip
        max_loras = self.config.max_loras
        # Not updated when a preemption below leaves an adapter unused: an adapter's request may wait a step more.
        adapters = {request.lora for request in self.running if request.lora is not None} if max_loras else set()
        while self.waiting:
            request = self.waiting.peek()
            if request in preempted:  # preempted in this step: readmitting it would only recompute what it lost
                return
            if max_loras and request.lora is not None and request.lora not in adapters and len(adapters) >= max_loras:
                passed_over.append(self.waiting.pop())
                continue
            admission = self._admission(request, token_budget)
            if admission is None:
                victims = self._victims_to_admit(request, token_budget, scheduled)
                if not victims:
                    return
                for victim in victims:
                    self._preempt(victim)
                    preempted.append(victim)
                    token_budget += _unschedule(victim, scheduled)
                admission = self._admission(request, token_budget)
            cached_block_ids, num_new_tokens, num_blocks = admission
            num_cached_tokens = len(cached_block_ids) * self.block_size
            reuses_cache = self.config.enable_prefix_caching and request.reuses_cached_prefix
            self.waiting.pop()
            for block_id in cached_block_ids:
                self.allocator.take_cached(block_id)
            request.block_ids = cached_block_ids + self.allocator.allocate(num_blocks)
            request.num_computed_tokens = num_cached_tokens
            if request.num_cached_tokens is None:  # a preempted request's recompute is not the prompt's cache hit
                request.num_cached_tokens = num_cached_tokens
            request.num_registered_blocks = len(cached_block_ids)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora is not None:
                adapters.add(request.lora)
            scheduled[request] = ScheduledRequest.of(request, num_new_tokens)
            token_budget -= num_new_tokens
            if reuses_cache:
                self.prefix_cache_queried_tokens += request.num_tokens
                self.prefix_cache_hit_tokens += num_cached_tokens

    def _admission(
        self, request: Request, token_budget: int, release: "_Release | None" = None
    ) -> tuple[list[int], int, int] | None:
        """How a waiting request would be admitted now (or once the running requests in `release` were preempted):
        (its cached prefix's blocks, its tokens to run, the new blocks they need); None if it does not fit (no seat,
        no tokens left in the budget, or too few free blocks)."""
        release = release or _NOTHING_RELEASED
        num_running = len(self.running) - release.num_requests
        token_budget += release.num_tokens
        if num_running >= self.config.max_num_seqs:
            return None
        reuses_cache = self.config.enable_prefix_caching and request.reuses_cached_prefix
        cached_block_ids = self._cached_prefix(request) if reuses_cache else []
        num_cached_tokens = len(cached_block_ids) * self.block_size
        num_new_tokens = self._num_tokens_to_run(request.num_tokens - num_cached_tokens, token_budget)
        if not num_new_tokens:
            return None
        num_blocks = -(-(num_cached_tokens + num_new_tokens) // self.block_size) - len(cached_block_ids)
        # Cached blocks nobody holds count as free until this request takes them.
        ref_count, holders = self.allocator.ref_count, release.holders
        num_taken_from_free = num_blocks + sum(ref_count(b) == holders[b] for b in cached_block_ids)
        # The watermark keeps room for running requests to grow; an idle engine admits anyway.
        watermark = self.config.watermark_blocks if num_running else 0
        if self.allocator.num_free_blocks + release.num_freed_blocks - num_taken_from_free < watermark:
            return None
        return cached_block_ids, num_new_tokens, num_blocks

    def _victims_to_admit(
        self, request: Request, token_budget: int, scheduled: dict[Request, ScheduledRequest]
    ) -> list[Request]:
        """Under the priority policy, the running requests of a larger priority value, lowest first and as few as
        let `request` in; none if even all of them would not (nothing is preempted in vain), and none under fcfs."""
        if self.config.policy != "priority":
            return []
        lower = [running for running in self.running if running.priority > request.priority]
        lower.sort(key=priority_order, reverse=True)
        release = _Release()
        for num_victims, victim in enumerate(lower, start=1):
            release.add(victim, scheduled.get(victim), self.allocator)
            if self._admission(request, token_budget, release) is not None:
                return lower[:num_victims]
        return []

    def _lowest_running(self) -> Request:
        """The running request preemption takes first: the most recently admitted (fcfs), or the one of the largest
        priority value, the latest arrival among equals (priority)."""
        if self.config.policy == "priority":
            return max(self.running, key=priority_order)
        return self.running[-1]

    def _cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the request's longest cached prefix of full blocks.

        The block with the last token is never reused: it is computed, so there are logits to sample.
        """
        num_candidate_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_block_keys(request, num_candidate_blocks)
        block_ids = []
        for key in request.block_keys[:num_candidate_blocks]:
            block_id = self.allocator.lookup(key)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def _extend_block_keys(self, request: Request, num_blocks: int) -> None:
        size, keys = self.block_size, request.block_keys
        for index in range(len(keys), num_blocks):
            tokens = tuple(request.token_ids(index * size, (index + 1) * size))
            extra_keys = block_extra_keys(not index, request.cache_salt, request.lora)
            keys.append(self.hasher.key(keys[index - 1] if index else None, tokens, extra_keys))

    def _register_full_blocks(self, request: Request) -> None:
        num_full_blocks = request.num_computed_tokens // self.block_size
        self._extend_block_keys(request, num_full_blocks)
        for index in range(request.num_registered_blocks, num_full_blocks):
            self.allocator.register(request.block_ids[index], request.block_keys[index])
        request.num_registered_blocks = num_full_blocks

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._left_running.append(request.request_id)
        self._release_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.put_back(request)

    def _release_blocks(self, request: Request) -> None:
        self.allocator.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0


@dataclass
class _Release:
    """What preempting some running requests would give back: their seats, the tokens they were scheduled for in
    this step, and the blocks no other request holds."""

    num_requests: int = 0
    num_tokens: int = 0
    holders: Counter = field(default_factory=Counter)  # block id -> how many of these requests hold it
    num_freed_blocks: int = 0

    def add(self, request: Request, scheduled: ScheduledRequest | None, allocator: BlockAllocator) -> None:
        self.num_requests += 1
        self.num_tokens += scheduled.num_new_tokens if scheduled else 0
        for block_id in request.block_ids:
            self.holders[block_id] += 1
            self.num_freed_blocks += self.holders[block_id] == allocator.ref_count(block_id)


_NOTHING_RELEASED = _Release()  # never added to: what `_admission` assumes without a release


def _unschedule(request: Request, scheduled: dict[Request, ScheduledRequest]) -> int:
    """Take a preempted request out of this step if it was scheduled already (decodes go first, so a lower request
    may have been); the tokens it gives back to the budget."""
    dropped = scheduled.pop(request, None)
    return dropped.num_new_tokens if dropped else 0
