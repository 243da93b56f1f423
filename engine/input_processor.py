"""Everything about a request before it is queued, in one place and once: the chat template, tokenization, every
check and default, and the grammar of structured outputs.

`process` turns a `GenerationRequest` into a `ProcessedRequest` or raises `InvalidRequestError` naming the field;
nothing it accepted is checked again downstream. It holds no per-request state and may run on any thread: the
server calls it on its event loop, or on a worker thread when the request has a grammar to build.
"""

from dataclasses import dataclass, replace

import jinja2

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.request import ChatPrompt, GenerationRequest, ProcessedRequest, Prompt
from kvserve.engine.sampling_params import GrammarSpec, SamplingParams
from kvserve.engine.structured_output import GrammarCompiler
from kvserve.scheduler import SchedulingPolicy


@dataclass(frozen=True)
class RequestLimits:
    """Caps a server puts on one request (None: no cap, as for the offline API)."""

    max_n: int | None = None
    max_prompts: int | None = None
    max_stop_strings: int | None = None
    max_stop_string_chars: int | None = None


NO_LIMITS = RequestLimits()


@dataclass(frozen=True)
class ModelLimits:
    """What the loaded model and its KV cache can hold."""

    vocab_size: int
    max_model_len: int  # the context window: prompt and output together
    num_cache_tokens: int  # the whole KV cache: one request can never hold more


class InputProcessor:
    def __init__(
        self, tokenizer, model: ModelLimits, grammars: GrammarCompiler, limits: RequestLimits = NO_LIMITS,
        chat_template: str | None = None, scheduling_policy: SchedulingPolicy = "fcfs",
    ) -> None:  # fmt: skip
        """`chat_template`: the server's own, over the tokenizer's; `scheduling_policy`: the engine's (only
        "priority" takes a request's priority)."""
        self.tokenizer = tokenizer
        self.model = model
        self.grammars = grammars
        self.limits = limits
        self.chat_template = chat_template or tokenizer.chat_template
        self.scheduling_policy = scheduling_policy

    def process(self, request: GenerationRequest) -> ProcessedRequest:
        self._check_request_caps(request)
        self._check_priority(request.priority)
        prompts = [self.prompt_token_ids(prompt) for prompt in request.prompts]
        params = [self._resolved_params(len(token_ids), request.params) for token_ids in prompts]
        if request.params.structured_output is not None:
            self.compile_grammar(request.params.structured_output)
        return ProcessedRequest(prompts, params, request.n, request.cache_salt, request.lora, request.priority)

    def compile_grammar(self, spec: GrammarSpec) -> None:
        """Build (or find cached) a grammar; `InvalidRequestError` naming the field it came from if it does not."""
        try:
            self.grammars.compile(spec)
        except InvalidRequestError as error:
            raise InvalidRequestError(spec.param, f"{spec.param}: {error.message}") from None

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """A prompt's tokens, checked: not empty, every id in the vocabulary."""
        if isinstance(prompt, ChatPrompt):
            if not prompt.messages:
                raise InvalidRequestError("messages", "messages must not be empty")
            token_ids = self.render_chat(prompt)
        elif not prompt:  # checked before encoding: a tokenizer that prepends BOS would make "" a prompt
            raise InvalidRequestError("prompt", "the prompt is empty")
        elif isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            self.check_token_ids(token_ids)
        if not token_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        return token_ids

    def check_token_ids(self, token_ids: list[int]) -> None:
        vocab_size = self.model.vocab_size
        bad = next(
            (t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None
        )
        if bad is not None:
            raise InvalidRequestError("prompt", f"token id {bad!r} is outside the vocabulary [0, {vocab_size})")

    def render_chat(self, prompt: ChatPrompt) -> list[int]:
        """The chat template applied to the conversation (and tools), tokenized."""
        if self.chat_template is None:
            message = "this model has no chat template; start the server with --chat-template"
            raise InvalidRequestError("messages", message)
        if prompt.tools and "tools" not in self.chat_template:
            raise InvalidRequestError("tools", "this model's chat template does not support tools")
        try:
            text = self.tokenizer.apply_chat_template(
                prompt.messages, tools=prompt.tools, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=prompt.add_generation_prompt,
            )  # fmt: skip
        except jinja2.TemplateError as error:
            raise InvalidRequestError("messages", f"the chat template rejected these messages: {error}") from None
        # The template writes any BOS it wants; encoding must not add a second one.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokenize(self, prompt: str | ChatPrompt, add_special_tokens: bool = True) -> list[int]:
        """Tokens of a text or a conversation, as /tokenize reports them (unchecked: an empty text has none)."""
        if isinstance(prompt, ChatPrompt):
            return self.prompt_token_ids(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.check_token_ids(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _check_request_caps(self, request: GenerationRequest) -> None:
        limits, stop = self.limits, request.params.stop
        _check_at_most("n", request.n, limits.max_n, low=1)
        if not request.prompts:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if limits.max_prompts is not None and len(request.prompts) > limits.max_prompts:
            raise InvalidRequestError("prompt", f"at most {limits.max_prompts} prompts, got {len(request.prompts)}")
        if limits.max_stop_strings is not None and len(stop) > limits.max_stop_strings:
            raise InvalidRequestError("stop", f"at most {limits.max_stop_strings} stop strings, got {len(stop)}")
        longest = limits.max_stop_string_chars
        if longest is not None and any(isinstance(s, str) and len(s) > longest for s in stop):
            raise InvalidRequestError("stop", f"stop strings are limited to {longest} characters")

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError("priority", f"priority must be an integer, got {priority!r}")
        if priority and self.scheduling_policy != "priority":
            # vLLM refuses it too: under first come, first served a priority would be silently ignored.
            raise InvalidRequestError(
                "priority",
                f"priority is only allowed with priority scheduling (--scheduling-policy priority), got {priority}",
            )

    def _resolved_params(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """`params` for this prompt (max_tokens None: the rest of the context), checked to fit it and the cache."""
        max_model_len = self.model.max_model_len
        if num_prompt_tokens >= max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {num_prompt_tokens} tokens: no room for output in the context window of "
                f"{max_model_len} tokens",
            )
        if params.max_tokens is None:
            params = replace(params, max_tokens=max_model_len - num_prompt_tokens)
        params.validate(self.model.vocab_size)
        max_tokens = params.max_tokens
        if num_prompt_tokens + max_tokens > max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: together more "
                f"than the context window of {max_model_len} tokens",
            )
        num_cache_tokens = self.model.num_cache_tokens
        if num_prompt_tokens + max_tokens > num_cache_tokens:
            raise InvalidRequestError(
                "max_tokens",
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the whole "
                f"KV cache ({num_cache_tokens} tokens)",
            )
        return params


def _check_at_most(name: str, value: int, high: int | None, low: int) -> None:
    if value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequestError(name, f"{name} must be {bounds}, got {value}")
