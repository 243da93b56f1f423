"""Anthropic's Messages API bodies (POST /v1/messages and /v1/messages/count_tokens), as pydantic models: the request
as the `anthropic` SDK's `messages.create` sends it, and the message kvserve returns.

Content blocks and tools of kinds kvserve does not serve (images, documents, thinking, server tools) are declared by
their `type` alone and refused by it (server/messages.py), whatever other fields they carry.
"""

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.server.protocol import RequestModel, StructuredOutputs


class _ByType(RequestModel):
    """A block or tool served only for some `type`s: its other fields are checked only for those."""

    SERVED_TYPES: ClassVar[frozenset[str | None]] = frozenset()

    def unknown_fields(self, path: str = "") -> list[str]:
        return super().unknown_fields(path) if self.type in self.SERVED_TYPES else []


class CacheControl(RequestModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_ByType):
    SERVED_TYPES: ClassVar[frozenset[str | None]] = frozenset({"text"})
    type: str
    text: str | None = None
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ContentBlock(_ByType):
    """A block of a message's content: text, tool_use (assistant turns), tool_result (user turns)."""

    SERVED_TYPES: ClassVar[frozenset[str | None]] = frozenset({"text", "tool_use", "tool_result"})
    type: str
    cache_control: CacheControl | None = None
    # text
    text: str | None = None
    citations: list[Any] | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class Message(RequestModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_ByType):
    """A client tool (`type` "custom" or left out); server tools (bash, web search, code execution, ...) are
    refused."""

    SERVED_TYPES: ClassVar[frozenset[str | None]] = frozenset({"custom", None})
    type: str | None = None
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None
    eager_input_streaming: bool | None = None  # the input is streamed as it is generated either way
    # Refused when set (server/messages.py).
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    input_examples: list[Any] | None = None


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    effort: str | None = None
    format: OutputFormat | None = None


class Metadata(RequestModel):
    user_id: str | None = None


class CountTokensRequest(RequestModel):
    """POST /v1/messages/count_tokens: what a message request's prompt is made of."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    model: str | None = None
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. Every field of the SDK's `MessageCreateParams` is declared, so that each one is acted on or
    refused by name (server/messages.py), with the sampling fields the API takes and vLLM's extras as in chat."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Refused whenever set.
    container: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    # vLLM's extras (as on chat).
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    priority: int = 0  # with --scheduling-policy priority (as on chat)
    speculative_decoding: bool = True  # kvserve's (as on chat)
    cache_salt: str | None = Field(default=None, min_length=1)
    structured_outputs: StructuredOutputs | None = None


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ToolUseOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorBody
