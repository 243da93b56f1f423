"""OpenAI request and response bodies (the subset kvserve serves), as pydantic models."""

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.engine.engine_state import EngineState
from kvserve.kvcache.block_map import STATE_NAMES, BlockState, encode_states


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class RequestModel(BaseModel):
    """A request body (or part of one). Strict: `true` is no token id, `"5"` no max_tokens and `1` no `stream`;
    only an integer where a float is expected passes, as JSON does not tell 1 from 1.0.

    Fields it does not declare are kept aside (`model_extra`), so that `unknown_fields` can name them: a misspelt or
    unsupported field is refused, never answered as if it were absent (server/supported_fields.py).
    """

    model_config = ConfigDict(strict=True, extra="allow")

    def unknown_fields(self, path: str = "") -> list[str]:
        """The dotted path of every field the request gave that no model declares, nested objects included."""
        unknown = [f"{path}{name}" for name in self.model_extra or {}]
        for name in type(self).model_fields:
            unknown += _unknown_fields_in(getattr(self, name), f"{path}{name}.")
        return unknown


def _unknown_fields_in(value: Any, path: str) -> list[str]:
    if isinstance(value, RequestModel):
        return value.unknown_fields(path)
    if isinstance(value, list):
        return [field for index, item in enumerate(value) for field in _unknown_fields_in(item, f"{path}{index}.")]
    return []


class StreamOptions(RequestModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # refused when true: kvserve pads no chunks


class JSONSchemaFormat(RequestModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(RequestModel):
    """Fields shared by completions and chat, including the vLLM extras clients send in `extra_body`.

    Fields the OpenAI API defines but kvserve does not serve are declared too, so that they are refused
    by name (see `server/supported_fields.py`) instead of ignored, as is any field nobody declares.
    """

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: shares cached prefixes only within a salt
    priority: int = 0  # vLLM's: lower runs first, with --scheduling-policy priority only (else anything but 0 is a 400)
    speculative_decoding: bool = True  # kvserve's: false keeps the request out of speculative decoding
    # SGLang's fields that vllm-router and sglang-router add to every request they forward, at these defaults:
    # accepted at values kvserve serves, refused otherwise (server/supported_fields.py).
    no_stop_trim: bool = False
    return_hidden_states: bool = False


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(RequestModel):
    """A part of a message's content: text is served; other types (images, audio, files) are refused by their type,
    whatever fields they carry."""

    type: str
    text: str | None = None

    def unknown_fields(self, path: str = "") -> list[str]:
        return super().unknown_fields(path) if self.type == "text" else []


class ToolCallFunction(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class MessageToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages that called tools
    tool_call_id: str | None = None  # tool messages: the call they answer


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Fields the routers also add to chat requests (vLLM's and SGLang's); see SamplingFields.
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    # OpenAI fields that are accepted only with the values kvserve serves (see server/supported_fields.py).
    modalities: list[str] | None = None
    service_tier: str | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # OpenAI fields that kvserve refuses whenever they are set.
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    metadata: Any = None
    moderation: Any = None
    prediction: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, "PromptLogprob"] | None] | None = None  # vLLM's extra


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None  # 1 for the likeliest token; None where the prompt's token is outside the top N
    decoded_token: str


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None  # left out of the body when the answer called no tools


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's extra; left out unless asked


def _absent_when_none(default=None, **kwargs):
    """A field a streamed chunk sends only when it has a value (as OpenAI's deltas do)."""
    return Field(default, exclude_if=lambda value: value is None, **kwargs)


class ToolCallFunctionDelta(BaseModel):
    name: str | None = _absent_when_none()  # with the call's first fragment only
    arguments: str = ""


class ToolCallDeltaOut(BaseModel):
    """A fragment of a streamed tool call: the first carries its id, type and name, the next ones arguments."""

    index: int
    id: str | None = _absent_when_none()
    type: Literal["function"] | None = _absent_when_none()
    function: ToolCallFunctionDelta


class ChatDelta(BaseModel):
    """What a chunk adds to a choice's message: the role in its first chunk, then content or tool call fragments."""

    role: Literal["assistant"] | None = _absent_when_none()
    content: str | None = _absent_when_none()
    tool_calls: list[ToolCallDeltaOut] | None = _absent_when_none()


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """A streamed chat event: choices' deltas, or (the last, with `include_usage`) no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _absent_when_none()


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionChunk(BaseModel):
    """A streamed completions event: each choice's new text, or (the last, with `include_usage`) the usage."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = _absent_when_none()


class ModelCard(BaseModel):
    """A served model: the base model, or (as vLLM lists them) a LoRA adapter with its directory as `root` and the
    base model as `parent`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    max_model_len: int
    root: str | None = None
    parent: str | None = None


class LoadLoraAdapterRequest(RequestModel):
    """vLLM's body of POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter already loaded under the name
    is_3d_lora_weight: bool = False  # vLLM's MoE expert weights in one tensor: refused when true


class UnloadLoraAdapterRequest(RequestModel):
    """vLLM's body of POST /v1/unload_lora_adapter."""

    lora_name: str
    lora_int_id: int | None = None  # if given, the loaded adapter's id must be this


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: str = Field(
        description='"ok"; "unhealthy"; or, while the server starts, "starting: " and the phase under way',
        pattern="^(ok|unhealthy|starting: .+)$",
    )


class VersionResponse(BaseModel):
    version: str


class KVBlockCounts(BaseModel):
    """Blocks by state; `used` (held + shared) and `available` (free + evictable) are the allocator's own counts."""

    total: int
    free: int
    held: int
    shared: int
    evictable: int
    used: int
    available: int


class KVCacheState(BaseModel):
    """The KV cache block by block. `states` holds one byte per block, indexed by block id, whose value indexes
    `state_names`; sent as base64 of the bytes, or as [state, run length] pairs, whichever is shorter."""

    block_size: int
    state_names: list[str]
    encoding: Literal["base64", "rle"]
    states: str | list[tuple[int, int]]
    shared: list[tuple[int, int]] = Field(description="[block id, ref count] of every shared block")
    blocks: KVBlockCounts
    num_live_tokens: int = Field(description="computed tokens of the running requests")
    num_unfilled_slots: int = Field(description="slots of held blocks that no token fills (tails of last blocks)")
    slot_utilization: float = Field(description="live tokens / slots of used blocks; above 1 when blocks are shared")
    fragmentation: float = Field(description="unfilled slots / slots of used blocks")
    prefix_cache_hit_rate: float | None = Field(description="hit / queried prompt tokens since start; null: none")


class RunningRequestInfo(BaseModel):
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    block_ranges: list[tuple[int, int]] = Field(description="its block table as runs of block ids, [start, end)")
    num_preemptions: int
    num_unfilled_slots: int
    lora_name: str | None = Field(None, description="the LoRA adapter it runs under (null: the base model)")
    priority: int = Field(0, description="its priority (lower runs first under --scheduling-policy priority)")


class RequestQueueState(BaseModel):
    running: list[RunningRequestInfo]
    num_waiting: int
    num_preempted_waiting: int
    waiting_by_priority: list[tuple[int, int]] = Field(
        description="[priority, waiting requests] for each priority that has requests waiting, lowest value first"
    )


class LatencyPercentiles(BaseModel):
    count: int
    p50: float
    p90: float
    p99: float


class LiveEngineFigures(BaseModel):
    """The engine's per-step stats over the last `window_s` seconds; each list has one sample a second, oldest
    first (queue sizes and KV usage as at the end of that second, token and preemption counts within it)."""

    window_s: int
    output_tokens_per_s: float
    time_to_first_token_s: LatencyPercentiles | None
    inter_token_latency_s: LatencyPercentiles | None
    prefix_cache_hit_rate: float | None
    spec_acceptance_length: float | None = Field(
        description="speculative decoding: tokens a request got from one verifying step (1 + accepted drafts), over "
        "the window; null: no drafts verified"
    )
    num_running: list[int]
    num_waiting: list[int]
    num_preempted_waiting: list[int]
    kv_usage: list[float]
    num_output_tokens: list[int]
    num_preemptions: list[int]


class EngineStateResponse(BaseModel):
    """GET /v1/engine/state: the console's snapshot, taken on the engine thread between two steps."""

    object: Literal["engine.state"] = "engine.state"
    taken_at: float = Field(description="when the snapshot was taken, Unix time")
    age_s: float = Field(description="how old the snapshot was when sent")
    kv_cache: KVCacheState
    requests: RequestQueueState
    live: LiveEngineFigures

    @classmethod
    def of(cls, state: EngineState, age_s: float) -> "EngineStateResponse":
        block_map, usage = state.block_map, state.kv_usage
        encoding, states = encode_states(block_map.states)
        blocks = KVBlockCounts(
            total=block_map.num_blocks,
            **{name: block_map.count(block_state) for name, block_state in zip(STATE_NAMES, BlockState, strict=True)},
            used=block_map.num_used_blocks,
            available=block_map.count(BlockState.FREE) + block_map.count(BlockState.EVICTABLE),
        )
        kv_cache = KVCacheState(
            block_size=state.block_size,
            state_names=list(STATE_NAMES),
            encoding=encoding,
            states=states,
            shared=list(block_map.shared),
            blocks=blocks,
            num_live_tokens=usage.num_live_tokens,
            num_unfilled_slots=state.num_unfilled_slots,
            slot_utilization=usage.slot_utilization,
            fragmentation=state.fragmentation,
            prefix_cache_hit_rate=state.prefix_cache_hit_rate,
        )
        requests = RequestQueueState(
            running=[RunningRequestInfo.model_validate(request, from_attributes=True) for request in state.running],
            num_waiting=state.num_waiting,
            num_preempted_waiting=state.num_preempted_waiting,
            waiting_by_priority=list(state.waiting_by_priority),
        )
        live = LiveEngineFigures.model_validate(state.live, from_attributes=True)
        return cls(taken_at=state.taken_at, age_s=age_s, kv_cache=kv_cache, requests=requests, live=live)
