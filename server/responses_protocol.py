"""OpenAI's Responses API bodies (POST /v1/responses), as pydantic models: the request as the `openai` SDK's
`responses.create` sends it, and the response object and output items kvserve returns and stores.

Items and tools of kinds kvserve does not serve (images, files, reasoning, built-in tools) are declared by their
`type` alone and refused by it (server/responses.py), whatever other fields they carry.
"""

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.server.protocol import RequestModel, StructuredOutputs


class _ByType(RequestModel):
    """A part, item or tool that is served only for some `type`s: its other fields are checked only for those."""

    SERVED_TYPES: ClassVar[frozenset[str]] = frozenset()

    def unknown_fields(self, path: str = "") -> list[str]:
        return super().unknown_fields(path) if self.type in self.SERVED_TYPES else []


class InputContent(_ByType):
    """A part of an input message: text (`input_text`, or `output_text` of an assistant turn sent back)."""

    SERVED_TYPES: ClassVar[frozenset[str]] = frozenset({"input_text", "output_text"})
    type: str
    text: str | None = None
    # An output part sent back as input carries what the response gave with it; the text alone is the turn.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputItem(_ByType):
    """An item of `input`: a message (its `type` may be left out), a function call the model made, or its output."""

    SERVED_TYPES: ClassVar[frozenset[str]] = frozenset({"message", "function_call", "function_call_output"})
    type: str = "message"
    id: str | None = None
    status: str | None = None
    # message
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContent] | None = None
    phase: str | None = None  # of an assistant message sent back: which part of a turn it was; the text alone counts
    # function_call
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    # function_call_output
    output: str | list[InputContent] | None = None


class FunctionTool(_ByType):
    """A tool: `function` is served; built-in tools (web search, file search, computer use, ...) are refused."""

    SERVED_TYPES: ClassVar[frozenset[str]] = frozenset({"function"})
    type: str
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceObject(_ByType):
    """`{"type": "function", "name": ...}` forces that function; other kinds (allowed tools, built-in tools) are
    refused."""

    SERVED_TYPES: ClassVar[frozenset[str]] = frozenset({"function"})
    type: str
    name: str | None = None


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # refused unless null: the model has no verbosity setting


class Reasoning(RequestModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(RequestModel):
    include_obfuscation: bool | None = None


class ResponsesRequest(RequestModel):
    """POST /v1/responses. Every field of the SDK's `ResponseCreateParams` is declared, so that each one is acted on
    or refused by name (server/responses.py); vLLM's sampling extras ride along as in chat."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, str] | None = None  # the Codex CLI's turn ids, for the client's own logs: not kept
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Refused whenever set (server/responses.py says why).
    background: bool | None = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    context_management: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    # vLLM's extras (as on chat).
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    priority: int = 0  # with --scheduling-policy priority (as on chat)
    speculative_decoding: bool = True  # kvserve's (as on chat)
    cache_salt: str | None = Field(default=None, min_length=1)
    structured_outputs: StructuredOutputs | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    """A response as POST returns it (and GET /v1/responses/{id} returns it again while it is stored)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputMessage | FunctionCallItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool
    temperature: float
    top_p: float
    top_logprobs: int
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    @property
    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage) for part in item.content)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
