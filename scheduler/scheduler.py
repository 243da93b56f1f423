"""Continuous batching: FCFS admission under KV-block and token budgets, preemption by recompute.

Every step schedules "N new tokens per request" in one batch: a request's uncomputed tail (the
prompt on first run, everything again after a preemption; in chunks under the token budget when
chunked prefill is on) or, when decoding, its one last sampled token. Decoding requests are served
first, then unfinished prefills, each oldest first; when one cannot grow, the most recently
admitted request is preempted (its blocks freed, put back at the front of the queue).
"""

from collections import Counter, deque

from kvserve.kvcache import BlockAllocator, BlockHasher, KVUsage, block_extra_keys
from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.request import FinishReason, Request, RequestStatus
from kvserve.scheduler.scheduler_output import LoraRequestCounts, ScheduledRequest, SchedulerOutput, SchedulerStats


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int) -> None:
        self.config = config
        self.allocator = allocator
        self.block_size = block_size
        self.hasher = BlockHasher(config.block_hash_seed)
        self.waiting: deque[Request] = deque()
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
        self.waiting.append(request)

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
                scheduled[request] = ScheduledRequest(request, 1, computed, True)
                token_budget -= 1
            elif request.status is RequestStatus.RUNNING:  # not preempted earlier in this loop
                token_budget = self._schedule_growing(request, token_budget, scheduled, preempted)
        for request in prefilling:
            if request.status is RequestStatus.RUNNING:
                token_budget = self._schedule_growing(request, token_budget, scheduled, preempted)
        scheduled_items = list(scheduled.values())
        if not preempted:
            self._admit_waiting(token_budget, scheduled_items)
        left_running, self._left_running = self._left_running, []
        return SchedulerOutput(scheduled=scheduled_items, preempted=preempted, left_running=left_running)

    def _schedule_growing(
        self, request: Request, token_budget: int, scheduled: dict[Request, ScheduledRequest], preempted: list[Request]
    ) -> int:
        """Schedule what of `request` fits the budget, preempting the newest requests if it needs blocks that are
        not free; the budget left."""
        num_new_tokens = self._num_tokens_to_run(request.num_uncomputed_tokens, token_budget)
        if not num_new_tokens:
            return token_budget
        num_preempted_before = len(preempted)
        granted = self._grow_or_preempt(request, num_new_tokens, preempted)
        # A newer request preempted for an older one may have been scheduled already (decodes go first): it
        # leaves this step and gives its tokens back.
        for victim in preempted[num_preempted_before:]:
            dropped = scheduled.pop(victim, None)
            token_budget += dropped.num_new_tokens if dropped else 0
        if granted:
            scheduled[request] = ScheduledRequest.of(request, num_new_tokens)
            token_budget -= num_new_tokens
        return token_budget

    def update(self, output: SchedulerOutput, sampled_token_ids: list[int]) -> None:
        """Record a finished step: computed tokens advance, sampling requests get their token.

        `sampled_token_ids` holds one id per scheduled request that samples, in schedule order.
        """
        sampled = iter(sampled_token_ids)
        caching, block_size = self.config.enable_prefix_caching, self.block_size
        for item in output.scheduled:
            request = item.request
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
        self.waiting.appendleft(request)

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
        )

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
        """Give `request` the blocks its new tokens need, preempting the newest requests if needed.

        Returns False when `request` itself had to be preempted.
        """
        num_blocks = self._num_blocks_to_add(request, num_new_tokens)
        while self.allocator.num_free_blocks < num_blocks:
            victim = self._preempt_newest()
            preempted.append(victim)
            if victim is request:
                return False
        request.block_ids.extend(self.allocator.allocate(num_blocks))
        return True

    def _admit_waiting(self, token_budget: int, scheduled: list[ScheduledRequest]) -> None:
        passed_over: list[Request] = []  # waiting for a free adapter slot, kept in order at the front
        try:
            self._admit_in_order(token_budget, scheduled, passed_over)
        finally:
            self.waiting.extendleft(reversed(passed_over))

    def _admit_in_order(self, token_budget: int, scheduled: list[ScheduledRequest], passed_over: list[Request]) -> None:
        max_loras = self.config.max_loras
        adapters = {request.lora for request in self.running if request.lora is not None} if max_loras else set()
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if max_loras and request.lora is not None and request.lora not in adapters and len(adapters) >= max_loras:
                passed_over.append(self.waiting.popleft())
                continue
            reuses_cache = self.config.enable_prefix_caching and request.reuses_cached_prefix
            cached_block_ids = self._cached_prefix(request) if reuses_cache else []
            num_cached_tokens = len(cached_block_ids) * self.block_size
            num_new_tokens = self._num_tokens_to_run(request.num_tokens - num_cached_tokens, token_budget)
            if not num_new_tokens:
                return
            num_blocks = -(-(num_cached_tokens + num_new_tokens) // self.block_size) - len(cached_block_ids)
            # Cached blocks nobody holds count as free until this request takes them.
            num_taken_from_free = num_blocks + sum(self.allocator.ref_count(b) == 0 for b in cached_block_ids)
            # The watermark keeps room for running requests to grow; an idle engine admits anyway.
            watermark = self.config.watermark_blocks if self.running else 0
            if self.allocator.num_free_blocks - num_taken_from_free < watermark:
                return
            self.waiting.popleft()
            for block_id in cached_block_ids:
                self.allocator.take_cached(block_id)
            request.block_ids = cached_block_ids + self.allocator.allocate(num_blocks)
            request.num_computed_tokens = num_cached_tokens
            request.num_registered_blocks = len(cached_block_ids)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora is not None:
                adapters.add(request.lora)
            scheduled.append(ScheduledRequest.of(request, num_new_tokens))
            token_budget -= num_new_tokens
            if reuses_cache:
                self.prefix_cache_queried_tokens += request.num_tokens
                self.prefix_cache_hit_tokens += num_cached_tokens

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

    def _preempt_newest(self) -> Request:
        request = self.running.pop()
        self._left_running.append(request.request_id)
        self._release_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        return request

    def _release_blocks(self, request: Request) -> None:
        self.allocator.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
