"""LLMEngine: the engine's parts wired together, for a caller that steps it itself (the offline `LLM`, tests).

A request goes in through the `InputProcessor` (template, tokens, checks, defaults, grammar), is scheduled and
stepped by the `EngineCore` (token ids only), and comes out through the `OutputProcessor` (text, stop strings,
logprob texts, deltas). The server's `AsyncLLMEngine` drives the same three parts, the core on a thread of its own.
"""

import itertools
import logging
from pathlib import Path

from kvserve.engine.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.default_model import DEFAULT_MODEL_NOTICE, default_model_dir
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.input_processor import NO_LIMITS, InputProcessor, ModelLimits, RequestLimits
from kvserve.engine.lora.peft_adapter import LoraAdapter, LoraAdapterError, read_peft_adapter
from kvserve.engine.model_loader import check_checkpoint_dir, load_decoder_config
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.outputs import RequestDelta
from kvserve.engine.request import CoreRequest, GenerationRequest, Prompt
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.startup import StartupProgress
from kvserve.engine.step_result import StepResult
from kvserve.engine.structured_output import GrammarCompiler
from kvserve.engine.tokenizer import eos_token_ids, load_tokenizer
from kvserve.kvcache import AdapterTag, KVUsage
from kvserve.scheduler import FinishReason

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, limits: RequestLimits = NO_LIMITS, chat_template: str | None = None,
        progress: StartupProgress | None = None,
    ) -> None:  # fmt: skip
        """`limits`: a server's caps on one request (the offline API has none); `chat_template`: one over the
        tokenizer's; `progress`: start-up's phases, logged and readable while they run (the server's /health)."""
        self.config = config
        progress = progress or StartupProgress()
        model_dir = Path(config.model) if config.model else default_model_dir()
        if config.model is None:
            logger.info(DEFAULT_MODEL_NOTICE)
        with progress.phase("checking the checkpoint and loading its tokenizer"):
            check_checkpoint_dir(model_dir)
            self.tokenizer = load_tokenizer(model_dir)
            eos = eos_token_ids(model_dir, self.tokenizer)
        grammars = GrammarCompiler(self.tokenizer, load_decoder_config(model_dir).vocab_size, eos)
        self.core = EngineCore(config, model_dir, eos, grammars, progress)
        core = self.core
        model_limits = ModelLimits(core.vocab_size, core.limits.max_model_len, core.kv_cache.num_tokens)
        self.inputs = InputProcessor(
            self.tokenizer, model_limits, grammars, limits, chat_template, config.scheduling_policy
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()
        for name, path in config.lora_modules:
            with progress.phase(f"loading LoRA adapter {name}"):
                self.load_lora(name, path)
        progress.finish()

    def add_request(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, cache_salt: str | None = None,
        lora_name: str | None = None, priority: int = 0,
    ) -> str:  # fmt: skip
        """Check and queue one request; returns its id. Raises `InvalidRequestError` for bad input. A request with
        a `cache_salt` shares cached prefix blocks only with requests of the same salt; `lora_name`: the loaded
        LoRA adapter to run under; `priority`: lower runs first (with `scheduling_policy="priority"` only)."""
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self.outputs:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        lora = self.lora_tag(lora_name)
        generation = GenerationRequest([prompt], params, cache_salt=cache_salt, lora=lora, priority=priority)
        processed = self.inputs.process(generation)
        token_ids, params = processed.prompt_token_ids[0], processed.params[0]
        self.submit(CoreRequest(request_id, token_ids, params, cache_salt, lora, processed.priority))
        return request_id

    # LoRA adapters

    def load_lora(self, name: str, path: str) -> AdapterTag:
        """Read a PEFT adapter and load it under `name` (`LoraAdapterError` naming what is wrong with it)."""
        return self.core.add_lora(self.read_lora(name, path))

    def read_lora(self, name: str, path: str) -> LoraAdapter:
        """An adapter's files, read and checked against this engine's settings (on any thread)."""
        if self.core.loras is None:
            raise LoraAdapterError("this engine does not serve LoRA adapters (start it with enable_lora)")
        return read_peft_adapter(name, path, self.config.max_lora_rank)

    def unload_lora(self, name: str) -> bool:
        """Unload an adapter (False if it is not loaded); requests running with it finish with it."""
        return self.core.loras is not None and self.core.remove_lora(name) is not None

    def lora_tag(self, name: str | None) -> AdapterTag | None:
        """The loaded adapter called `name` (None: the base model); `InvalidRequestError` if there is none."""
        if name is None:
            return None
        tag = self.core.loras.tag(name) if self.core.loras is not None else None
        if tag is None:
            raise InvalidRequestError("model", f"no LoRA adapter {name!r} is loaded")
        return tag

    def new_request_id(self) -> str:
        return f"req-{next(self._request_counter)}"

    def submit(self, request: CoreRequest) -> None:
        """Queue a request the input processor accepted."""
        self.outputs.add(request.request_id, request.params)
        self.core.add(request)

    def step(self) -> list[RequestDelta]:
        """Run one batch; the delta of every request that released tokens or finished."""
        return self.process(self.core.step())

    def process(self, result: StepResult) -> list[RequestDelta]:
        """A core step's tokens as deltas; requests a stop string ended are finished in the core too."""
        processed = self.outputs.process(result.outputs)
        for request_id in processed.stopped:
            self.core.finish(request_id, FinishReason.STOP)
        return processed.deltas

    def abort(self, request_id: str) -> RequestDelta | None:
        """Remove a request wherever it is and free its blocks at once; its last delta, or None if it is unknown."""
        self.core.finish(request_id)
        return self.outputs.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def kv_usage(self) -> KVUsage:
        return self.core.kv_usage()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (the engine takes no more steps)."""
        self.core.close()
