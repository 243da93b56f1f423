"""EngineCore: the step loop's owner — scheduler, model runner and sampler — over token ids only.

It queues `CoreRequest`s the input processor accepted and, each step, schedules a batch, runs the model, samples
one token for every request that reached its last token, and applies the stop conditions it can see without text:
stop tokens (EOS unless ignored, `stop_token_ids`), `max_tokens`, and a grammar that rejects a token. With
speculative decoding on, a decoding request also runs the draft tokens the proposer gives it (a draft model gives
them once the step is scheduled) and gets every draft the model's choice agrees with, then the model's own next
token, in one step (greedy: the same tokens as without drafts; sampled: the same distribution).
What a step did comes back as one typed `StepResult`; text, stop strings and deltas are the output processor's.

Besides the step it keeps the policies that decide what a step computes: prompt logprobs (`PromptScoring`), and
LongRoPE's rule that a sequence grown past the original context computes its cache again with the long rotary set.
"""

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.cpu_memory import keep_freed_memory_resident
from kvserve.engine.default_model import default_draft_dir, default_model_dir
from kvserve.engine.engine_state import EngineState, StatsWindow, take_engine_state
from kvserve.engine.lora.manager import LoraManager
from kvserve.engine.lora.peft_adapter import LoraAdapter
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.models.moe import SparseMoeBlock
from kvserve.engine.parallel.launch import start_ranks
from kvserve.engine.pooling import Pooler, read_pooling_config
from kvserve.engine.prompt_scoring import PromptScoring
from kvserve.engine.request import CoreRequest
from kvserve.engine.sampler import LogitBias, PenaltyState, SamplingRow, sample, to_device
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.speculative import (
    Proposer,
    SpeculationController,
    SpeculativeConfig,
    grammars_after_drafts,
    make_proposer,
    num_accepted_drafts,
)
from kvserve.engine.speculative.config import DEFAULT_DRAFT
from kvserve.engine.speculative.draft_model import (
    UNPROPOSED,
    DraftModel,
    draft_kv_spec,
    load_draft_model,
)
from kvserve.engine.startup import StartupProgress
from kvserve.engine.step_result import EMPTY_STEP, CoreOutput, StepResult
from kvserve.engine.structured_output import GrammarCompiler, TokenMasks
from kvserve.engine.worker import Worker
from kvserve.kvcache import AdapterTag, BlockAllocator, BlockKey, KVUsage
from kvserve.kvcache.block_hash import resolve_hash_seed
from kvserve.kvcache.events import BlocksStored, CacheEvent
from kvserve.scheduler import (
    FinishReason,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)

if TYPE_CHECKING:
    import llguidance

    from kvserve.engine.kv_events import KVEventPublisher

logger = logging.getLogger(__name__)
NO_TOKEN = -1  # what an embedding request "samples": it finishes with its vector instead


@dataclass
class _Sampling:
    """A request's sampling state beside the scheduler's token state."""

    params: SamplingParams
    row: SamplingRow  # its generator (seeded requests), penalty counts, logit bias and grammar
    stop_token_ids: frozenset[int]  # its stop ids, and EOS unless it ignores it
    lora: AdapterTag | None  # the LoRA adapter it runs under


class EngineCore:
    def __init__(
        self, config: EngineConfig, model_dir: Path, eos_token_ids: frozenset[int], grammars: GrammarCompiler,
        progress: StartupProgress | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.device = config.torch_device()
        if self.device.type == "cpu":
            keep_freed_memory_resident()
        self.model_dir = model_dir
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        pooling = read_pooling_config(model_dir, config.task, config.pooling, config.normalize)
        self.pooler = Pooler(pooling) if pooling is not None else None  # None: the engine generates
        # With tensor parallelism the other ranks start here and build their shards beside this one.
        self.ranks = start_ranks(config, model_dir, self.device) if config.tensor_parallel_size > 1 else None
        try:
            self._build_worker(config, progress or StartupProgress())
        except Exception as error:
            # A rank that died while loading shows here as a broken collective: name the rank, not the socket.
            gone = self.rank_failure()
            self.kill_ranks()
            if gone is not None:
                raise RuntimeError(f"{gone} while the engine was starting ({error})") from error
            raise
        except BaseException:
            self.kill_ranks()
            raise
        num_blocks = self.kv_cache.num_blocks
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=self.limits.max_num_batched_tokens,
                watermark_blocks=int(num_blocks * config.watermark_fraction),
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_prefill_chunk_tokens=config.max_prefill_chunk_tokens,
                enable_prefix_caching=config.enable_prefix_caching,
                block_hash_seed=resolve_hash_seed(config.prefix_cache_hash_seed),
                max_loras=config.max_loras if config.enable_lora else None,
                policy=config.scheduling_policy,
            ),
            BlockAllocator(num_blocks, record_events=config.kv_events_endpoint is not None),
            config.block_size,
        )
        self.loras = LoraManager(config.max_loras, self.runner.worker.write_lora) if config.enable_lora else None
        self.kv_events = self._start_kv_events(config)
        # A logit row per request, and one per draft with speculative decoding: any of them may have a grammar.
        speculative = config.speculative_config
        max_rows = config.max_num_seqs * (1 + (speculative.num_speculative_tokens if speculative is not None else 0))
        self._token_masks = TokenMasks(max_rows, grammars.mask_vocab_size, self.vocab_size, self.device)
        self._sampling: dict[str, _Sampling] = {}
        self._prompt_scoring = PromptScoring()
        self._generator = torch.Generator(device=self.device).manual_seed(config.seed)  # for unseeded requests
        self.proposer, self.speculation = self._speculation(config.speculative_config)

    def _speculation(self, config: SpeculativeConfig | None) -> tuple[Proposer | None, SpeculationController | None]:
        """The proposer of a text method (None for a draft model: `self.draft_model`), and the controller."""
        if config is None:
            return None, None
        if self.pooler is not None:
            raise ValueError("speculative_config is for generation; this engine makes embeddings")
        if self.runner.worker.inputs.long_rope is not None:
            # A draft past the original context would need the long rotary set before the request is that long.
            raise ValueError("speculative_config is not supported with LongRoPE models (Phi-3 long-context) yet")
        proposer = make_proposer(config) if config.method != "draft_model" else None
        controller = SpeculationController(
            config.num_speculative_tokens, config.adaptive, drafts_catch_up=config.method == "draft_model"
        )
        return proposer, controller

    def _start_kv_events(self, config: EngineConfig) -> "KVEventPublisher | None":
        if config.kv_events_endpoint is None:
            return None
        from kvserve.engine.kv_events import KVEventPublisher, KVEventsConfig  # pyzmq only when events are on

        settings = KVEventsConfig(
            endpoint=config.kv_events_endpoint,
            block_size=config.block_size,
            medium="GPU" if self.device.type == "cuda" else "CPU",
            replay_endpoint=config.kv_events_replay_endpoint,
            topic=config.kv_events_topic,
            queue_size=config.kv_events_queue_size,
            replay_batches=config.kv_events_replay_batches,
            format=config.kv_events_format,
            int_hashes=config.kv_events_int_hashes,
        )
        try:
            return KVEventPublisher(settings)
        except BaseException:
            self.kill_ranks()
            raise

    def _build_worker(self, config: EngineConfig, progress: StartupProgress) -> None:
        group = self.ranks.group if self.ranks is not None else None
        draft = None
        speculative = config.speculative_config
        if speculative is not None and speculative.method == "draft_model":
            with progress.phase("loading the draft model"):
                draft = load_draft_model(config, self._draft_dir(speculative.model), self.device)
        draft_bytes = draft_kv_spec(config, draft).bytes_per_token if draft is not None else 0
        worker = Worker.load(config, self.model_dir, self.device, group, progress, draft_bytes)
        self.runner = ModelRunner(worker, config.max_num_seqs, group)
        self.model, self.kv_cache, self.limits = worker.model, worker.kv_cache, worker.limits
        self.draft_model = None
        if draft is not None:
            self.draft_model = DraftModel.build(
                draft, config, worker.model, worker.kv_cache.num_blocks, worker.limits, self.device
            )
        self.vocab_size = self.model.config.vocab_size
        self._moe_blocks = [module for module in self.model.modules() if isinstance(module, SparseMoeBlock)]
        self.take_expert_tokens()  # the warm-up's and captures' tokens are no load

    def _draft_dir(self, model: str) -> Path:
        if model != DEFAULT_DRAFT:
            return Path(model)
        if self.model_dir.resolve() != default_model_dir().resolve():
            raise ValueError(
                f"speculative_config model {DEFAULT_DRAFT!r} is the built-in model's draft; for {self.model_dir} give "
                "a draft checkpoint's directory (a smaller model with its tokenizer)"
            )
        return default_draft_dir()

    # Requests

    def add(self, request: CoreRequest) -> None:
        """Queue a request the input processor accepted."""
        params, token_ids = request.params, request.prompt_token_ids
        seeded = params.seed is not None and not params.is_greedy
        row = SamplingRow(
            params,
            generator=torch.Generator(device=self.device).manual_seed(params.seed) if seeded else None,
            penalties=PenaltyState.of(token_ids, self.vocab_size, self.device) if params.has_penalties else None,
            logit_bias=LogitBias.of(params.logit_bias, self.device) if params.logit_bias else None,
            grammar=self.grammars.matcher(params.structured_output) if params.structured_output else None,
        )
        # A cached prefix has no logits: a request that wants the prompt's logprobs computes all of it.
        wants_prompt_logprobs = params.prompt_logprobs is not None
        scheduled = Request(
            request.request_id, token_ids, reuses_cached_prefix=not wants_prompt_logprobs,
            cache_salt=request.cache_salt, lora=request.lora, priority=request.priority,
        )  # fmt: skip
        if self._rotates_long(scheduled) or self.pooler is not None:
            _keep_out_of_prefix_cache(scheduled)
        self.scheduler.add(scheduled)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        self._sampling[request.request_id] = _Sampling(params, row, frozenset(stop_ids), request.lora)
        if request.lora is not None:
            self.loras.acquire(request.lora)
        if wants_prompt_logprobs:
            self._prompt_scoring.add(scheduled, params.prompt_logprobs)

    def finish(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Take a request out wherever it is and free its blocks at once (an abort, or a stop string the output
        processor found); False if the core no longer has it."""
        request = self.scheduler.get(request_id)
        if request is None:
            return False
        self.scheduler.finish(request, reason)
        self._forget(request)
        return True

    def finish_all(self) -> list[str]:
        """Abort every request (a failed step, a shutdown); their ids."""
        request_ids = list(self._sampling)
        for request_id in request_ids:
            self.finish(request_id)
        return request_ids

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # The step

    def step(self) -> StepResult:
        """Run one batch; the token of every request that sampled, and what ran."""
        if self.runner.worker.inputs.long_rope is not None:
            self._recompute_requests_grown_past_short_rope()
        start_s = time.perf_counter()
        speculating = self.speculation is not None and self._propose_drafts()
        scheduler_output = self.scheduler.schedule()
        if self.draft_model is not None:
            self.draft_model.release(scheduler_output.left_running)
            if speculating:
                self.draft_model.propose(
                    scheduler_output.scheduled, self._grammars(scheduler_output), self._token_masks
                )
        if scheduler_output.is_empty:
            self.runner.release(scheduler_output.left_running)  # no plan carries them to the planner
            return EMPTY_STEP
        if self.pooler is not None:
            return self._embedding_step(scheduler_output)
        states, sampling, rows, num_draft_rows = self._sampling, [], [], 0
        for item in scheduler_output.scheduled:
            if item.samples_next_token:
                request = item.request
                state = states[request.request_id]
                sampling.append((request, state, item.num_draft_tokens))
                rows += self._sampling_rows(request, state, item.num_draft_tokens)
                num_draft_rows += item.num_draft_tokens
        prompt_rows, prompt_targets = self._prompt_scoring.rows(scheduler_output)
        lora_slots = None
        if self.loras is not None:
            lora_slots = self.loras.slots_for(item.request.lora for item in scheduler_output.scheduled)
        logits = self.runner.execute(scheduler_output, prompt_rows, lora_slots)
        if prompt_rows:
            self._prompt_scoring.record(logits[len(rows) :], prompt_targets)
        sampled = sample(logits[: len(rows)], rows, self._generator, self._token_masks)
        new_tokens, num_accepted = None, []
        if num_draft_rows:
            new_tokens, num_accepted = _verify_drafts(sampling, sampled.token_ids)
            self.scheduler.update(scheduler_output, [tokens[-1] for tokens in new_tokens], num_accepted)
            accepted = iter(num_accepted)
            for (request, state, num_drafts), tokens in zip(sampling, new_tokens, strict=True):
                if num_drafts:
                    self.speculation.verified(request.request_id, num_drafts, next(accepted))
                if len(tokens) > 1 and state.row.penalties is not None:
                    # The first token was counted as its row sampled it; the others were counted on the draft rows'
                    # copies of the counts, which end with this step.
                    state.row.penalties.count(to_device(tokens[1:], torch.long, self.device))
        else:
            self.scheduler.update(scheduler_output, sampled.token_ids)
        outputs, logprobs, row = [], sampled.logprobs, 0
        for index, (request, state, num_drafts) in enumerate(sampling):
            # Without drafts, one token a request; with them, a request's accepted drafts and the token after them.
            tokens = (sampled.token_ids[index],) if new_tokens is None else new_tokens[index]
            first_row, row = row, row + 1 + num_drafts  # a token's logprobs are its row's
            num_before = len(request.output_token_ids) - len(tokens)
            for position, token_id in enumerate(tokens):
                logprob = logprobs.get(first_row + position) if logprobs else None
                reason = self._finish_reason(request, state, token_id, num_before + position + 1)
                output = CoreOutput(request.request_id, token_id, logprob, reason)
                if position == 0 and state.params.prompt_logprobs is not None:
                    output.prompt_logprobs = self._prompt_scoring.take_complete(request)
                if num_before + position == 0:
                    output.num_cached_tokens = request.num_cached_tokens
                outputs.append(output)
                if reason is not None:
                    del request.output_token_ids[num_before + position + 1 :]  # accepted drafts after a stop token
                    self.scheduler.finish(request, reason)
                    self._forget(request)
                    break
        if self.kv_events is not None:
            self._publish_kv_events()
        if self.speculation is not None:  # its rate, for deciding whether to speculate at this batch size
            pure_decode = (
                len(sampling)
                == len(scheduler_output.scheduled)
                == (scheduler_output.num_batched_tokens - num_draft_rows)
            )
            elapsed_s = time.perf_counter() - start_s
            # Measured by what it verified: a step the controller gave drafts but that had none (no match yet, no
            # room) ran as a plain one. (Drafts are cleared each step, so only a speculating step has any.)
            with_drafts = num_draft_rows > 0
            self.speculation.stepped(len(sampling), with_drafts, len(outputs), elapsed_s, pure_decode)
        return StepResult(outputs, scheduler_output, sum(num_accepted))

    def _propose_drafts(self) -> bool:
        """Draft tokens for every decoding request that speculates, when no prompt waits for the step's budget and
        the controller says this batch size gains by it (none for the others): as many as its acceptance earns, never
        past its max_tokens or the context window. Whether the step speculates."""
        scheduler = self.scheduler
        decoding = [request for request in scheduler.running if request.num_uncomputed_tokens == 1]
        for request in scheduler.running:
            request.draft_token_ids = []
        # Prompt tokens waiting for the step's budget (a prefill under way, or a request a free seat would admit)
        # come before drafts, which would take budget from them.
        prefill_pending = len(decoding) < len(scheduler.running) or (
            scheduler.waiting and len(scheduler.running) < self.config.max_num_seqs
        )
        if prefill_pending or not self.speculation.speculates(len(decoding)):
            return False
        max_model_len = self.limits.max_model_len
        for request in decoding:
            state = self._sampling[request.request_id]
            room = min(
                self.speculation.num_drafts(request.request_id),
                state.params.max_tokens - len(request.output_token_ids) - 1,
                max_model_len - request.num_tokens - 1,
            )
            if room > 0 and self._speculates(state):
                if self.draft_model is not None:  # slots the draft model fills once the step is scheduled
                    request.draft_token_ids = [UNPROPOSED] * room
                else:
                    drafts = self.proposer.propose(request.prompt_token_ids + request.output_token_ids, room)
                    grammar = state.row.grammar
                    if grammar is not None:  # drafts past the first the grammar refuses would be rejected
                        drafts = drafts[: grammar.validate_tokens(drafts)]
                    request.draft_token_ids = drafts
        return True

    def _grammars(self, scheduler_output: SchedulerOutput) -> "dict[str, llguidance.LLMatcher]":
        """The grammar matchers of the step's requests with drafts and structured outputs, by request id."""
        grammars = {}
        for item in scheduler_output.scheduled:
            grammar = self._sampling[item.request.request_id].row.grammar if item.num_draft_tokens else None
            if grammar is not None:
                grammars[item.request.request_id] = grammar
        return grammars

    @staticmethod
    def _speculates(state: "_Sampling") -> bool:
        """Whether the request verifies drafts: it did not opt out. Each row samples as decoding would after the
        drafts before it (`_sampling_rows`), and the rule that then keeps its output's distribution is
        `num_accepted_drafts`'. (Its prompt logprobs, if it wants them, are all scored before its first draft: a
        request gets drafts only once its prompt is computed.)"""
        return state.params.speculative_decoding

    def _embedding_step(self, scheduler_output: SchedulerOutput) -> StepResult:
        """Run one batch of embedding requests' prompt chunks; each request whose prompt is done finishes with its
        pooled vector (and frees its blocks at once)."""
        lora_slots = None
        if self.loras is not None:
            lora_slots = self.loras.slots_for(item.request.lora for item in scheduler_output.scheduled)
        hidden = self.runner.execute(scheduler_output, self.pooler.rows(scheduler_output), lora_slots)
        finished = self.pooler.collect(scheduler_output, hidden)
        self.scheduler.update(scheduler_output, [NO_TOKEN] * len(finished))
        outputs = []
        for request, vector in finished:
            outputs.append(CoreOutput(request.request_id, NO_TOKEN, None, FinishReason.STOP, num_cached_tokens=0,
                                      embedding=vector.tolist()))  # fmt: skip
            self.scheduler.finish(request, FinishReason.STOP)
            self._forget(request)
        if self.kv_events is not None:
            self._publish_kv_events()
        return StepResult(outputs, scheduler_output)

    def _publish_kv_events(self) -> None:
        events = self.scheduler.allocator.take_events()
        if self.loras is not None:
            events = [self._with_lora_id(event) for event in events]
        if events:
            self.kv_events.publish(events)

    def _with_lora_id(self, event: CacheEvent) -> CacheEvent:
        if not isinstance(event, BlocksStored) or event.lora_name is None:
            return event
        return replace(event, lora_id=self.loras.adapter_id(event.lora_name))

    @property
    def num_dropped_kv_events(self) -> int:
        return self.kv_events.num_dropped_events if self.kv_events is not None else 0

    def _finish_reason(
        self, request: Request, sampling: "_Sampling", token_id: int, num_output_tokens: int
    ) -> FinishReason | None:
        """Why the token, the request's `num_output_tokens`-th, ends it, if it does: a stop token, max_tokens, or a
        grammar that rejects it."""
        grammar = sampling.row.grammar
        if grammar is not None and not grammar.consume_token(token_id):
            # The mask allowed only tokens the grammar accepts: this is a bug, not the request's fault.
            logger.error("request %s: its grammar rejected sampled token %d", request.request_id, token_id)
            return FinishReason.ABORT
        if token_id in sampling.stop_token_ids:
            return FinishReason.STOP
        if num_output_tokens >= sampling.params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _sampling_rows(self, request: Request, sampling: "_Sampling", num_drafts: int) -> list[SamplingRow]:
        """The rows its next token and the token after each of its `num_drafts` drafts are sampled with: each as
        decoding without drafts would sample it had the drafts before it been output (penalties count them, so does
        min_tokens, and a grammar has consumed them)."""
        first = self._sampling_row(request, sampling) if sampling.params.min_tokens else sampling.row
        if not num_drafts:
            return [first]
        grammar = first.grammar
        if first.penalties is None and grammar is None and len(request.output_token_ids) >= sampling.params.min_tokens:
            return [first] * (1 + num_drafts)
        drafts = request.draft_token_ids[:num_drafts]
        grammars = grammars_after_drafts(grammar, drafts) if grammar is not None else None
        rows, penalties = [first], first.penalties
        for ahead, draft in enumerate(drafts, start=1):
            row = self._sampling_row(request, sampling, ahead)
            if penalties is not None:
                penalties = penalties.with_counted(draft)
                row = replace(row, penalties=penalties)
            if grammars is not None:
                row = replace(row, grammar=grammars[ahead - 1])
            rows.append(row)
        return rows

    def _sampling_row(self, request: Request, sampling: "_Sampling", ahead: int = 0) -> SamplingRow:
        """Its row for the token `ahead` tokens after its output so far; before min_tokens, one that bans EOS and the
        stop ids."""
        params = sampling.params
        if len(request.output_token_ids) + ahead >= params.min_tokens:
            return sampling.row
        banned = params.stop_token_ids + (() if params.ignore_eos else tuple(self.eos_token_ids))
        return replace(sampling.row, banned_token_ids=banned)

    def _forget(self, request: Request) -> None:
        request_id = request.request_id
        lora = self._sampling.pop(request_id).lora
        if self.speculation is not None:
            self.speculation.forget(request_id)
        if self.proposer is not None:
            self.proposer.finished(request.output_token_ids)
        self._prompt_scoring.discard(request_id)
        if self.pooler is not None:
            self.pooler.discard(request_id)
        if lora is not None and self.loras.release(lora):
            self._forget_cached_blocks(lora)

    # LoRA adapters

    def add_lora(self, adapter: LoraAdapter) -> AdapterTag:
        """Load an adapter read from its files (`ValueError` if the name is taken); requests may use it at once."""
        self.runner.worker.lora_slots.check(adapter)
        return self.loras.add(adapter)

    def remove_lora(self, name: str) -> AdapterTag | None:
        """Unload an adapter (None if it is not loaded): new requests cannot use it; running ones finish with it.
        Its cached blocks are forgotten once none does, so the name loaded again never finds them."""
        tag = self.loras.remove(name)
        if tag is not None and not self.loras.runs(tag):
            self._forget_cached_blocks(tag)
        return tag

    def _forget_cached_blocks(self, tag: AdapterTag) -> None:
        key = ("lora", tag.name, tag.path)

        def made_by_adapter(block: BlockKey) -> bool:
            return key in (block.extra_keys or ())

        self.scheduler.allocator.forget_cached(made_by_adapter)

    def _rotates_long(self, request: Request) -> bool:
        """LongRoPE: a sequence longer than the original context rotates all its tokens with the long set."""
        long_rope = self.runner.worker.inputs.long_rope
        return long_rope is not None and request.num_tokens > long_rope[0]

    def _recompute_requests_grown_past_short_rope(self) -> None:
        """A sequence that grew past the original context computes its whole cache again with the long
        frequencies, as HF does (Phi-3's `prepare_inputs_for_generation` drops its cache there)."""
        # Whether a request still shares the prefix cache tells that its keys were rotated with the short set.
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            if request.caches_blocks and self._rotates_long(request):
                _keep_out_of_prefix_cache(request)
                if request.status is RequestStatus.RUNNING:
                    self.scheduler.recompute(request)

    # What the engine reports between steps

    def kv_usage(self) -> KVUsage:
        return self.scheduler.kv_usage()

    def queue_stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def engine_state(self, window: StatsWindow, now_s: float, wall_time_s: float) -> EngineState:
        """The console's snapshot: between steps only."""
        return take_engine_state(self.scheduler, window, now_s, wall_time_s)

    def take_expert_tokens(self) -> list[int]:
        """Tokens routed to each expert, summed over the MoE layers, since the last call (empty without experts).
        Waits for the device: call it now and then, not every step."""
        if not self._moe_blocks:
            return []
        counts = torch.stack([block.expert_tokens for block in self._moe_blocks]).sum(dim=0).tolist()
        for block in self._moe_blocks:
            block.expert_tokens.zero_()
        return counts

    # Tensor-parallel ranks

    def rank_failure(self) -> str | None:
        """Why a tensor-parallel rank this engine started is gone (it exited), or None."""
        return self.ranks.failure() if self.ranks is not None else None

    def kill_ranks(self) -> None:
        """End the other ranks at once (a collective failed: they are out of step and may not hear a stop)."""
        if self.ranks is not None:
            self.ranks.kill()

    def kill_rank_processes(self) -> None:
        """Kill the ranks this engine spawned, and nothing else (any thread may call it: the group stays joined)."""
        if self.ranks is not None:
            self.ranks.kill_processes()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any, and the events publisher (the core takes no more steps)."""
        if self.kv_events is not None:
            self.kv_events.close()
        if self.ranks is not None:
            self.ranks.stop()

    @property
    def embeds(self) -> bool:
        """Whether this engine makes embeddings (each request one pooled vector) instead of generating."""
        return self.pooler is not None

    @property
    def is_tensor_parallel(self) -> bool:
        return self.ranks is not None


def _verify_drafts(
    sampling: list[tuple[Request, "_Sampling", int]], target_token_ids: list[int]
) -> tuple[list[list[int]], list[int]]:
    """Each sampling request's new tokens (its accepted drafts, then the target's token after them), and for each
    request with drafts, how many were accepted. `target_token_ids`: the sampled token of every logit row."""
    new_tokens, num_accepted, row = [], [], 0
    for request, _, num_drafts in sampling:
        targets = target_token_ids[row : row + 1 + num_drafts]
        row += 1 + num_drafts
        if num_drafts:
            accepted = num_accepted_drafts(request.draft_token_ids[:num_drafts], targets)
            num_accepted.append(accepted)
            targets = targets[: accepted + 1]
        new_tokens.append(targets)
    return new_tokens, num_accepted


def _keep_out_of_prefix_cache(request: Request) -> None:
    # LongRoPE: its keys are rotated with the long set, not those a shorter sequence's prefix would have. An
    # embedding: a cached block has no hidden states to pool, and its KV is dropped once the prompt is computed.
    request.reuses_cached_prefix = request.caches_blocks = False
