"""LLMEngine: the synchronous core that ties scheduler, KV cache, model runner and sampler together."""

import itertools
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.cpu_memory import keep_freed_memory_resident
from kvserve.engine.decode_graphs import capture_sizes
from kvserve.engine.default_model import DEFAULT_MODEL_NOTICE, default_model_dir
from kvserve.engine.detokenizer import IncrementalDetokenizer, StopStringFilter, special_token_ids
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.kv_sizing import build_kv_cache, log_kv_cache, step_limits
from kvserve.engine.model_loader import check_checkpoint_dir, checkpoint_dtype, load_model
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.models.moe import SparseMoeBlock
from kvserve.engine.outputs import RequestDelta, TokenLogprob
from kvserve.engine.parallel.launch import start_ranks
from kvserve.engine.sampler import LogitBias, PenaltyState, SampledToken, SamplingRow, prompt_logprobs, sample
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.structured_output import GrammarCompiler, TokenMasks
from kvserve.engine.tokenizer import eos_token_ids, load_tokenizer
from kvserve.kvcache import BlockAllocator, KVUsage
from kvserve.scheduler import FinishReason, Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    """Engine-side state of a request beside the scheduler's token state: sampling, and what is
    generated but not yet released (held back with text that may begin a stop string)."""

    request: Request
    params: SamplingParams
    sampling_row: SamplingRow  # its generator (seeded requests) and penalty counts; what it bans is per step
    detokenizer: IncrementalDetokenizer
    stop_filter: StopStringFilter
    num_released_tokens: int = 0
    held_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With `prompt_logprobs`: those computed so far (the first token has none); sent once, when complete.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False

    def release(self, text: str, finish_reason: str | None = None) -> RequestDelta:
        """The tokens generated since the last release, with `text` and their logprobs."""
        output_token_ids = self.request.output_token_ids
        logprobs = None
        if self.params.logprobs is not None:
            logprobs, self.held_logprobs = self.held_logprobs, []
        token_ids = output_token_ids[self.num_released_tokens :]
        self.num_released_tokens = len(output_token_ids)
        delta = RequestDelta(self.request.request_id, token_ids, text, logprobs, finish_reason)
        if self.prompt_logprobs_complete and not self.prompt_logprobs_sent:
            delta.prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return delta

    @property
    def prompt_logprobs_complete(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.request.prompt_token_ids)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device()
        if self.device.type == "cpu":
            keep_freed_memory_resident()
        self.model_dir = Path(config.model) if config.model else default_model_dir()
        if config.model is None:
            logger.info(DEFAULT_MODEL_NOTICE)
        check_checkpoint_dir(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = eos_token_ids(self.model_dir, self.tokenizer)
        self.special_token_ids = special_token_ids(self.tokenizer)
        self.dtype = config.torch_dtype(self.device, checkpoint_dtype(self.model_dir))
        # With tensor parallelism the other ranks start here and build their shards beside this one.
        self.ranks = start_ranks(config, self.model_dir, self.device) if config.tensor_parallel_size > 1 else None
        try:
            self._build_model_and_cache(config)
        except BaseException:
            if self.ranks is not None:
                self.ranks.kill()
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
            ),
            BlockAllocator(num_blocks),
            config.block_size,
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._token_masks = TokenMasks(config.max_num_seqs, self.grammars.mask_vocab_size, self.vocab_size, self.device)
        self._states: dict[str, _RequestState] = {}
        self._scoring_prompts: set[str] = set()  # requests whose prompt logprobs are not all computed yet
        self._generator = torch.Generator(device=self.device).manual_seed(config.seed)  # for unseeded requests
        self._request_counter = itertools.count()
        log_kv_cache(self.model, self.kv_cache, self.device, self.model_dir)

    def _build_model_and_cache(self, config: EngineConfig) -> None:
        group = self.ranks.group if self.ranks is not None else None
        self.model = load_model(self.model_dir, self.dtype, self.device, group)
        self._moe_blocks = [module for module in self.model.modules() if isinstance(module, SparseMoeBlock)]
        self.vocab_size = self.model.config.vocab_size
        self.limits = step_limits(config, self.model.config)
        self.max_model_len = self.limits.max_model_len
        self.kv_cache, backend = build_kv_cache(config, self.model, self.device, self.limits, group)
        self.runner = ModelRunner(
            self.model, self.kv_cache, backend, self.device, config.max_num_seqs, self.limits.max_num_batched_tokens,
            self.max_model_len, group,
        )  # fmt: skip
        if self.device.type == "cuda":
            logger.info("kernels compiled and warmed up in %.1f s", self.runner.warm_up())
            # Tensor-parallel steps run eagerly: their collectives are not captured in graphs (yet).
            if not config.enforce_eager and group is None:
                self.runner.capture_decode_graphs(capture_sizes(config.max_num_seqs))
            self.take_expert_tokens()  # the warm-up's and captures' tokens are no load

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (the engine takes no more steps)."""
        if self.ranks is not None:
            self.ranks.stop()

    def rank_failure(self) -> str | None:
        """Why a tensor-parallel rank this engine started is gone (it exited), or None."""
        return self.ranks.failure() if self.ranks is not None else None

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:  # fmt: skip
        """Validate and queue a request; returns its id. Raises `InvalidRequestError` for bad input. A request with
        a `cache_salt` shares cached prefix blocks only with requests of the same salt."""
        request_id = request_id if request_id is not None else f"req-{next(self._request_counter)}"
        if request_id in self._states:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        prompt_token_ids = self.tokenize_prompt(prompt)
        self.check_params(len(prompt_token_ids), params)
        self.enqueue(request_id, prompt_token_ids, params, cache_salt)
        return request_id

    def check_params(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """`InvalidRequestError` unless `params` are valid and the request fits the context and the cache."""
        params.validate(self.vocab_size)
        self._check_fits(num_prompt_tokens, params.max_tokens)

    def enqueue(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        """Queue a request whose prompt (`tokenize_prompt`) and params (`check_params`) were checked.

        Its grammar, if it has one, is compiled here unless `grammars.compile` did it before (as the server does,
        on another thread); `InvalidRequestError` if it does not compile, and nothing is queued.
        """
        seeded = params.seed is not None and not params.is_greedy
        sampling_row = SamplingRow(
            params,
            generator=torch.Generator(device=self.device).manual_seed(params.seed) if seeded else None,
            penalties=PenaltyState.of(prompt_token_ids, self.vocab_size, self.device) if params.has_penalties else None,
            logit_bias=LogitBias.of(params.logit_bias, self.device) if params.logit_bias else None,
            grammar=self.grammars.matcher(params.structured_output) if params.structured_output else None,
        )
        # A cached prefix has no logits: a request that wants the prompt's logprobs computes all of it.
        wants_prompt_logprobs = params.prompt_logprobs is not None
        request = Request(
            request_id, prompt_token_ids, reuses_cached_prefix=not wants_prompt_logprobs, cache_salt=cache_salt
        )
        if self._rotates_long(request):
            self._keep_out_of_prefix_cache(request)
        self.scheduler.add(request)
        self._states[request_id] = _RequestState(
            request=request,
            params=params,
            sampling_row=sampling_row,
            detokenizer=IncrementalDetokenizer(self.tokenizer, self.special_token_ids, params.skip_special_tokens),
            stop_filter=StopStringFilter(params.stop),
            prompt_logprobs=[None] if wants_prompt_logprobs else None,
        )
        if wants_prompt_logprobs and len(prompt_token_ids) > 1:
            self._scoring_prompts.add(request_id)

    def abort(self, request_id: str) -> RequestDelta | None:
        """Remove a request wherever it is and free its blocks at once; its last delta, or None if it is unknown."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        state = self._states.pop(request_id)
        self._scoring_prompts.discard(request_id)
        return state.release(state.stop_filter.flush(), FinishReason.ABORT.value)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def kv_usage(self) -> KVUsage:
        return self.scheduler.kv_usage()

    def take_expert_tokens(self) -> list[int]:
        """Tokens routed to each expert, summed over the MoE layers, since the last call (empty without experts).
        Waits for the device: call it now and then, not every step."""
        if not self._moe_blocks:
            return []
        counts = torch.stack([block.expert_tokens for block in self._moe_blocks]).sum(dim=0).tolist()
        for block in self._moe_blocks:
            block.expert_tokens.zero_()
        return counts

    def step(self) -> list[RequestDelta]:
        """Run one batch; return the delta of every request that released tokens or finished."""
        if self.runner.inputs.long_rope is not None:
            self._recompute_requests_grown_past_short_rope()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        states = [
            self._states[item.request.request_id] for item in scheduler_output.scheduled if item.samples_next_token
        ]
        prompt_rows, prompt_targets = self._prompt_logprob_rows(scheduler_output)
        logits = self.runner.execute(scheduler_output, prompt_rows)
        if prompt_rows:
            self._record_prompt_logprobs(logits[len(states) :], prompt_targets)
        rows = [self._sampling_row(state) for state in states]
        sampled = sample(logits[: len(states)], rows, self._generator, self._token_masks)
        self.scheduler.update(scheduler_output, [token.token_id for token in sampled])
        deltas = []
        for state, token in zip(states, sampled, strict=True):
            delta = self._process_token(state, token)
            if delta is None:
                continue
            if delta.finished:
                del self._states[state.request.request_id]
            deltas.append(delta)
        return deltas

    def _rotates_long(self, request: Request) -> bool:
        """LongRoPE: a sequence longer than the original context rotates all its tokens with the long set."""
        long_rope = self.runner.inputs.long_rope
        return long_rope is not None and request.num_tokens > long_rope[0]

    def _keep_out_of_prefix_cache(self, request: Request) -> None:
        # Its keys are rotated with the long set: not those a shorter sequence's prefix would have.
        request.reuses_cached_prefix = request.caches_blocks = False

    def _recompute_requests_grown_past_short_rope(self) -> None:
        """A sequence that grew past the original context computes its whole cache again with the long
        frequencies, as HF does (Phi-3's `prepare_inputs_for_generation` drops its cache there)."""
        # Whether a request still shares the prefix cache tells that its keys were rotated with the short set.
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            if request.caches_blocks and self._rotates_long(request):
                self._keep_out_of_prefix_cache(request)
                if request.status is RequestStatus.RUNNING:
                    self.scheduler.recompute(request)

    def _prompt_logprob_rows(self, output: SchedulerOutput) -> tuple[list[int], list[tuple[_RequestState, int]]]:
        """The step's token rows whose logits score a prompt token still without a logprob, and for each
        its request and that token (the logits at position p score prompt token p + 1)."""
        rows, targets = [], []
        if not self._scoring_prompts:
            return rows, targets
        first_row = 0
        for item in output.scheduled:
            if item.request.request_id in self._scoring_prompts:
                state = self._states[item.request.request_id]
                prompt = item.request.prompt_token_ids
                # A preempted request recomputes its prompt: positions already scored are skipped.
                first = max(item.start_position, len(state.prompt_logprobs) - 1)
                end = min(item.start_position + item.num_new_tokens, len(prompt) - 1)
                for position in range(first, end):
                    rows.append(first_row + position - item.start_position)
                    targets.append((state, prompt[position + 1]))
            first_row += item.num_new_tokens
        return rows, targets

    def _record_prompt_logprobs(self, logits: torch.Tensor, targets: list[tuple[_RequestState, int]]) -> None:
        num_top = [state.params.prompt_logprobs for state, _ in targets]
        entries = prompt_logprobs(logits, [token_id for _, token_id in targets], num_top)
        for (state, _), entry in zip(targets, entries, strict=True):
            state.prompt_logprobs.append(entry)
            if state.prompt_logprobs_complete:
                self._scoring_prompts.discard(state.request.request_id)

    def _sampling_row(self, state: _RequestState) -> SamplingRow:
        params = state.params
        if len(state.request.output_token_ids) >= params.min_tokens:
            return state.sampling_row
        banned = params.stop_token_ids + (() if params.ignore_eos else tuple(self.eos_token_ids))
        return replace(state.sampling_row, banned_token_ids=banned)

    def _process_token(self, state: _RequestState, token: SampledToken) -> RequestDelta | None:
        """Detokenize the new token, finish the request if a stop condition holds, and release what is certain.

        A stop token (EOS unless ignored, or one of `stop_token_ids`) stays in `token_ids` but adds no text.
        None when the step released nothing (text held back for a stop string or an incomplete character). A
        token that adds no text while nothing is held back (a skipped special token) is released with empty text.
        """
        request, params = state.request, state.params
        if params.logprobs is not None:
            state.held_logprobs.append(TokenLogprob(token.token_id, token.logprob, token.top_logprobs))
        grammar = state.sampling_row.grammar
        if grammar is not None and not grammar.consume_token(token.token_id):
            # The mask allowed only tokens the grammar accepts: this is a bug, not the request's fault.
            logger.error("request %s: its grammar rejected sampled token %d", request.request_id, token.token_id)
            return self._finish(state, state.stop_filter.flush(), FinishReason.ABORT)
        num_tokens = len(request.output_token_ids)
        if token.token_id in params.stop_token_ids or (not params.ignore_eos and token.token_id in self.eos_token_ids):
            return self._finish(state, state.stop_filter.flush(), FinishReason.STOP)
        new_text = state.detokenizer.push(token.token_id)
        # Like EOS and stop ids, stop strings only count once min_tokens tokens exist.
        text, stopped = state.stop_filter.push(new_text, can_stop=num_tokens >= params.min_tokens)
        if stopped:
            return self._finish(state, text, FinishReason.STOP)
        if num_tokens >= params.max_tokens:
            return self._finish(state, text + state.stop_filter.flush(), FinishReason.LENGTH)
        if text or not (state.detokenizer.holds_text or state.stop_filter.holds_text):
            return state.release(text)
        return None

    def _finish(self, state: _RequestState, text: str, reason: FinishReason) -> RequestDelta:
        self.scheduler.finish(state.request, reason)
        return state.release(text, reason.value)

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text or token-id prompt; `InvalidRequestError` if empty or outside the vocabulary."""
        # Checked before encoding: a tokenizer that prepends BOS would turn "" into a non-empty prompt.
        if not prompt:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            bad = next(
                (t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size),
                None,
            )
            if bad is not None:
                raise InvalidRequestError(
                    "prompt", f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})"
                )
        if not token_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        return token_ids

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {num_prompt_tokens} tokens: no room for output in the context window of "
                f"{self.max_model_len} tokens",
            )
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: together more "
                f"than the context window of {self.max_model_len} tokens",
            )
        num_tokens_held = self.kv_cache.num_tokens
        if num_prompt_tokens + max_tokens > num_tokens_held:
            raise InvalidRequestError(
                "max_tokens",
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the whole "
                f"KV cache ({num_tokens_held} tokens)",
            )
