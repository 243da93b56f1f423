"""What a front end asks the engine for, in the engine's own terms, and what the input processor makes of it.

The server's protocol translators (OpenAI completions and chat, later others) map their bodies onto one
`GenerationRequest`; the input processor checks it once and turns it into a `ProcessedRequest`: each prompt's
tokens and its own sampling settings, with every default resolved. Its choices (n samples of each prompt) are what
the engine core schedules, one `CoreRequest` each.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from kvserve.engine.sampling_params import SamplingParams
from kvserve.kvcache import AdapterTag


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation, rendered by the chat template: messages as templates take them (dicts with `role`,
    `content` as text, and `tool_calls` with their arguments as objects), and the tools to show the model."""

    messages: list[dict]
    tools: list[dict] | None = None
    add_generation_prompt: bool = True


# Text (encoded with the tokenizer's special tokens, e.g. BOS), token ids as they are, or a conversation.
Prompt = str | list[int] | ChatPrompt


@dataclass(frozen=True)
class GenerationRequest:
    """`n` samples of each prompt. `params.max_tokens` None means the rest of each prompt's context window.
    `cache_salt`: cached prefix blocks are shared only with requests of the same salt. `lora`: the LoRA adapter
    to run under (None: the base model). `priority`: under the priority scheduling policy, lower runs first (vLLM's
    meaning); anything but 0 is refused under fcfs."""

    prompts: list[Prompt]
    params: SamplingParams
    n: int = 1
    cache_salt: str | None = None
    lora: AdapterTag | None = None
    priority: int = 0


@dataclass(frozen=True)
class CoreRequest:
    """One sequence to generate, as the engine core schedules it; `lora`: the adapter it runs under; `priority`: its
    place in the priority policy's order (lower first)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    lora: AdapterTag | None = None
    priority: int = 0


@dataclass(frozen=True)
class ProcessedRequest:
    """A request the input processor accepted: each prompt's tokens and settings (max_tokens resolved for it)."""

    prompt_token_ids: list[list[int]]
    params: list[SamplingParams]  # one per prompt
    n: int
    cache_salt: str | None = None
    lora: AdapterTag | None = None
    priority: int = 0
    num_choices: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_choices", len(self.prompt_token_ids) * self.n)

    def core_requests(self, request_id: str) -> Iterator[CoreRequest]:
        """Choice i is sample i % n of prompt i // n, with id `{request_id}-{i}`; with a seed, sample k of a prompt
        draws with seed + k, so each choice is reproducible alone."""
        for prompt_index, (token_ids, params) in enumerate(zip(self.prompt_token_ids, self.params, strict=True)):
            for sample in range(self.n):
                seeded = params if params.seed is None or not sample else replace(params, seed=params.seed + sample)
                index = prompt_index * self.n + sample
                yield CoreRequest(f"{request_id}-{index}", token_ids, seeded, self.cache_salt, self.lora, self.priority)

    def prompt_of(self, choice_index: int) -> list[int]:
        return self.prompt_token_ids[choice_index // self.n]
