"""What the bench sends to each API and how it reads each API's stream: the request body, and per streamed event
whether it carries generated tokens, the usage it reports, or the error it is.

- completions, chat: OpenAI chunks, usage in the last one (`stream_options.include_usage`).
- responses: typed events; tokens in `response.output_text.delta`, usage in the final response.
- messages: Anthropic's events; tokens in `content_block_delta`, prompt tokens in `message_start`, output tokens in
  `message_delta`.
"""

from dataclasses import dataclass
from typing import Literal

Endpoint = Literal["completions", "chat", "responses", "messages"]
ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses",
    "messages": "/v1/messages",
}  # fmt: skip


@dataclass(frozen=True)
class StreamEvent:
    carries_tokens: bool = False
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    error: object = None  # the error object the event is (its message is read by the client)


def request_body(
    endpoint: Endpoint, model: str, prompt: str, max_tokens: int, temperature: float, ignore_eos: bool
) -> dict:
    body: dict = {"model": model, "temperature": temperature, "stream": True}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extra field, which kvserve takes on every endpoint
    if endpoint == "completions":
        return {**body, "prompt": prompt, "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "stream_options": {"include_usage": True}}  # fmt: skip
    if endpoint == "responses":
        return {**body, "input": prompt, "max_output_tokens": max_tokens, "store": False}
    return {**body, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}


def read_event(endpoint: Endpoint, event: dict) -> StreamEvent:
    if endpoint in ("completions", "chat"):
        return _read_openai_chunk(event)
    kind = event.get("type")
    if kind == "error":
        return StreamEvent(error=event.get("error", event))
    if endpoint == "responses":
        if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            return StreamEvent(carries_tokens=True)
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            usage = (event.get("response") or {}).get("usage") or {}
            return StreamEvent(prompt_tokens=usage.get("input_tokens"), output_tokens=usage.get("output_tokens"))
        return StreamEvent()
    if kind == "content_block_delta":
        return StreamEvent(carries_tokens=True)
    if kind == "message_start":
        usage = (event.get("message") or {}).get("usage") or {}
        if "input_tokens" not in usage:
            return StreamEvent()
        # Anthropic counts the prompt tokens read from the cache apart from input_tokens: the prompt is all of them.
        cached = sum(usage.get(key) or 0 for key in ("cache_read_input_tokens", "cache_creation_input_tokens"))
        return StreamEvent(prompt_tokens=usage["input_tokens"] + cached)
    if kind == "message_delta":
        return StreamEvent(output_tokens=(event.get("usage") or {}).get("output_tokens"))
    return StreamEvent()


def _read_openai_chunk(chunk: dict) -> StreamEvent:
    if "error" in chunk:
        return StreamEvent(error=chunk)
    usage = chunk.get("usage") or {}
    return StreamEvent(
        carries_tokens=_carries_tokens(chunk), prompt_tokens=usage.get("prompt_tokens"),
        output_tokens=usage.get("completion_tokens"),
    )  # fmt: skip


def _carries_tokens(chunk: dict) -> bool:
    """Completions chunks each carry a step's tokens (the text may be empty while a character is incomplete);
    a chat stream opens with a delta that only names the role, which is no token yet."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    delta = choices[0].get("delta")
    return delta is None or not ("role" in delta and not delta.get("content"))
