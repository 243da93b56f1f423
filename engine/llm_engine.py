"""LLMEngine: the synchronous core that ties scheduler, KV cache, model runner and sampler together."""

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.cpu_memory import keep_freed_memory_resident
from engine.default_model import RANDOM_WEIGHTS_NOTICE, default_model_dir
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.errors import InvalidRequestError
from engine.kv_sizing import kv_cache_budget_bytes
from engine.model_loader import check_checkpoint_dir, checkpoint_dtype, load_model
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampler import SampledToken, SamplingRow, sample
from engine.sampling_params import SamplingParams
from engine.tokenizer import eos_token_ids, load_tokenizer
from kernels import AttentionShape, select_attention_backend
from kvcache import BlockAllocator, KVCache, KVCacheSpec, KVUsage
from scheduler import FinishReason, Request, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    """Engine-side state of a request beside the scheduler's token state."""

    request: Request
    params: SamplingParams
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    text: str = ""
    logprobs: list[TokenLogprob] | None = field(default=None)

    def snapshot(self) -> RequestOutput:
        reason = self.request.finish_reason
        return RequestOutput(
            request_id=self.request.request_id,
            prompt_token_ids=self.request.prompt_token_ids,
            token_ids=list(self.request.output_token_ids),
            text=self.text,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=reason.value if reason is not None else None,
        )


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device()
        if self.device.type == "cpu":
            keep_freed_memory_resident()
        self.model_dir = Path(config.model) if config.model else default_model_dir()
        if config.model is None:
            logger.warning(RANDOM_WEIGHTS_NOTICE)
        check_checkpoint_dir(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = eos_token_ids(self.model_dir, self.tokenizer)
        self.dtype = config.torch_dtype(self.device, checkpoint_dtype(self.model_dir))
        self.model = load_model(self.model_dir, self.dtype, self.device)
        model_config = self.model.config
        self.vocab_size = model_config.vocab_size
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
        )

        default_budget = 2048 if config.enable_chunked_prefill else max(2048, self.max_model_len)
        max_num_batched_tokens = config.max_num_batched_tokens or default_budget
        if not config.enable_chunked_prefill and max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) without chunked prefill: a whole prompt is prefilled in one step"
            )
        spec = KVCacheSpec(
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            dtype=config.torch_kv_cache_dtype(self.dtype),
            block_size=config.block_size,
        )
        backend = select_attention_backend(
            config.attention_backend,
            self.device,
            AttentionShape(config.max_num_seqs, model_config.num_heads, model_config.head_dim),
        )
        budget_bytes = kv_cache_budget_bytes(config, self.model, spec, backend, self.device, max_num_batched_tokens)
        num_blocks = spec.num_blocks_for_budget(budget_bytes)
        self.kv_cache = KVCache.allocate(spec, num_blocks, self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, backend, self.device)

        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                watermark_blocks=int(num_blocks * config.watermark_fraction),
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_prefill_chunk_tokens=config.max_prefill_chunk_tokens,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
            BlockAllocator(num_blocks),
            config.block_size,
        )
        self._states: dict[str, _RequestState] = {}
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._request_counter = itertools.count()
        logger.info(
            "loaded %s (%s, %s on %s); KV cache (%s%s): %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes a token)",
            self.model_dir,
            type(self.model).__name__,
            self.dtype,
            self.device,
            spec.dtype,
            " + fp32 scales per token and head" if spec.quantized else "",
            num_blocks,
            config.block_size,
            self.kv_cache.num_tokens,
            self.kv_cache.total_bytes / 2**20,
            spec.bytes_per_token,
        )

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id. Raises `InvalidRequestError` for bad input."""
        request_id = request_id if request_id is not None else f"req-{next(self._request_counter)}"
        if request_id in self._states:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        prompt_token_ids = self.check_request(prompt, params)
        generator = None
        if not params.is_greedy:
            seed = (
                params.seed
                if params.seed is not None
                else int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            )
            generator = torch.Generator(device=self.device).manual_seed(seed)
        request = Request(request_id=request_id, prompt_token_ids=prompt_token_ids)
        self.scheduler.add(request)
        self._states[request_id] = _RequestState(
            request=request,
            params=params,
            generator=generator,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            stop_matcher=StopStringMatcher(params.stop),
            logprobs=[] if params.logprobs is not None else None,
        )
        return request_id

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids if the request can be served; else `InvalidRequestError`. Changes nothing."""
        prompt_token_ids = self.tokenize_prompt(prompt)
        params.validate(self.vocab_size)
        self._check_fits(len(prompt_token_ids), params.max_tokens)
        return prompt_token_ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """Remove a request wherever it is and free its blocks at once; None if it is unknown."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        return self._states.pop(request_id).snapshot()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def kv_usage(self) -> KVUsage:
        return self.scheduler.kv_usage()

    def step(self) -> list[RequestOutput]:
        """Run one batch; return a snapshot of every request that got a token this step."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        states = [
            self._states[item.request.request_id] for item in scheduler_output.scheduled if item.samples_next_token
        ]
        logits = self.runner.execute(scheduler_output)
        sampled = sample(logits, [self._sampling_row(state) for state in states])
        self.scheduler.update(scheduler_output, [token.token_id for token in sampled])
        outputs = []
        for state, token in zip(states, sampled, strict=True):
            self._process_token(state, token)
            if state.request.is_finished:
                del self._states[state.request.request_id]
            outputs.append(state.snapshot())
        return outputs

    def _sampling_row(self, state: _RequestState) -> SamplingRow:
        params, output_token_ids = state.params, state.request.output_token_ids
        banned: tuple[int, ...] = ()
        if len(output_token_ids) < params.min_tokens:
            banned = params.stop_token_ids + (() if params.ignore_eos else tuple(self.eos_token_ids))
        return SamplingRow(
            params=params,
            generator=state.generator,
            prompt_token_ids=state.request.prompt_token_ids,
            output_token_ids=output_token_ids,
            banned_token_ids=banned,
        )

    def _process_token(self, state: _RequestState, token: SampledToken) -> None:
        """Append the token's text and logprobs, then finish the request if a stop condition holds.

        A stop token (EOS unless ignored, or one of `stop_token_ids`) stays in `token_ids` but adds no text.
        """
        request, params = state.request, state.params
        if state.logprobs is not None:
            state.logprobs.append(TokenLogprob(token.token_id, token.logprob, token.top_logprobs))
        if token.token_id in params.stop_token_ids or (not params.ignore_eos and token.token_id in self.eos_token_ids):
            self.scheduler.finish(request, FinishReason.STOP)
            return
        new_text = state.detokenizer.decode_new(request.output_token_ids)
        state.text += new_text
        # Like EOS and stop ids, stop strings only count once min_tokens tokens exist.
        can_stop = len(request.output_token_ids) >= params.min_tokens
        stop_at = state.stop_matcher.find(state.text, len(new_text) if can_stop else 0)
        if stop_at >= 0:
            state.text = state.text[:stop_at]
            self.scheduler.finish(request, FinishReason.STOP)
        elif len(request.output_token_ids) >= params.max_tokens:
            self.scheduler.finish(request, FinishReason.LENGTH)

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
