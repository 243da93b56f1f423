"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): the request translated into a chat
request (`system` and system turns as system messages, tool_result blocks as tool messages, tool_use blocks as the
assistant's tool calls, `output_config.format` as the response format), generated as chat is, and returned as
Anthropic's message, or its stream of events. Errors on these routes take Anthropic's shape (server/errors.py).

Images, documents, thinking, server tools, containers and reasoning effort are refused by name. A tool_result with
`is_error` reaches the model as its text after "Error: " (chat templates have no field for it).
"""

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.server.anthropic_protocol import (
    ContentBlock,
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    MessageUsage,
    TextBlock,
    TextOut,
    TokenCount,
    ToolUseOut,
)
from kvserve.server.chat import chat_prompt, start_chat
from kvserve.server.context import ServerContext
from kvserve.server.errors import anthropic_error, bad_request, renamed_params, to_api_error
from kvserve.server.generation import Generation, event_stream
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.tool_calling import ToolPlan
from kvserve.server.tool_parsers import ToolCall

_REFUSED_FIELDS = {
    "container": "containers (code execution) are not supported",
    "diagnostics": "diagnostics are not supported",
    "inference_geo": "inference_geo is not supported: inference runs where this server runs",
}
# What a request's errors name when they come from the chat request it became.
_CHAT_TO_MESSAGES_PARAMS = {"stop": "stop_sequences", "prompt": "messages", "response_format": "output_config.format",
                            "response_format.json_schema.schema": "output_config.format.schema"}  # fmt: skip


async def create_message(body: MessagesRequest, request: Request, ctx: ServerContext):
    ctx.check_known_fields(body)
    _check_fields(body)
    with renamed_params(_CHAT_TO_MESSAGES_PARAMS):
        generation, tool_plan = await start_chat(_chat_request(body), ctx, f"msg_{uuid.uuid4().hex}")
    if body.stream:
        return StreamingResponse(
            event_stream(_events(generation, tool_plan), generation), media_type="text/event-stream"
        )
    await generation.run_to_end(request)
    choice = generation.choices[0]
    parsed = tool_plan.parse(choice.text)
    content: list[TextOut | ToolUseOut] = [TextOut(text=parsed.content)] if parsed.content else []
    content += [_tool_use(call) for call in parsed.tool_calls]
    stop_reason = "tool_use" if parsed.tool_calls else _stop_reason(choice.finish_reason, choice.stop_string)
    message = MessageResponse(
        id=generation.request_id, model=generation.model, content=content, stop_reason=stop_reason,
        stop_sequence=choice.stop_string if stop_reason == "stop_sequence" else None, usage=_usage(generation),
    )  # fmt: skip
    return JSONResponse(message.model_dump())


async def count_tokens(body: CountTokensRequest, ctx: ServerContext) -> TokenCount:
    """The prompt's tokens as /v1/messages would make them: the chat template over the turns and the tools."""
    ctx.check_known_fields(body)
    ctx.check_model(body.model)
    _check_fields(body)
    chat = _chat_request(body)
    tools = (
        None if chat.tool_choice == "none" or not chat.tools else [t.model_dump(exclude_none=True) for t in chat.tools]
    )
    with renamed_params(_CHAT_TO_MESSAGES_PARAMS):
        tokens = ctx.engine.tokenize(chat_prompt(chat.messages, add_generation_prompt=True, tools=tools))
    return TokenCount(input_tokens=len(tokens))


def _check_fields(body: CountTokensRequest) -> None:
    for name, reason in _REFUSED_FIELDS.items():
        if getattr(body, name, None) is not None:
            raise bad_request(reason, param=name)
    if body.thinking is not None and body.thinking.type != "disabled":
        raise bad_request("this model does not think: only thinking of type 'disabled' is supported", param="thinking")
    if body.output_config is not None and body.output_config.effort is not None:
        raise bad_request("`output_config.effort` is not supported", param="output_config.effort")
    if body.speed == "fast":
        raise bad_request("speed 'fast' is not supported", param="speed")
    for index, tool in enumerate(body.tools or []):
        param = f"tools.{index}"
        if tool.type not in tool.SERVED_TYPES:
            raise bad_request(
                f"server tools ({tool.type!r}) are not supported: only client tools", param=f"{param}.type"
            )
        if tool.name is None or tool.input_schema is None:
            raise bad_request("a tool needs a name and an input_schema", param=f"{param}.input_schema")
        if tool.defer_loading:
            raise bad_request("deferred tool loading (tool search) is not supported", param=f"{param}.defer_loading")
        if tool.allowed_callers not in (None, ["direct"]):
            raise bad_request("tools are called by the model only", param=f"{param}.allowed_callers")
        if tool.input_examples:
            raise bad_request("tool input examples are not supported", param=f"{param}.input_examples")
    choice = body.tool_choice
    if choice is not None and choice.type == "tool" and choice.name is None:
        raise bad_request("tool_choice of type 'tool' needs the tool's name", param="tool_choice.name")


def _chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    messages = [] if body.system is None else [{"role": "system", "content": _system_text(body.system)}]
    for index, message in enumerate(body.messages):
        messages += _chat_messages(message.role, message.content, f"messages.{index}")
    fields: dict = {"model": body.model, "messages": messages}
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                              "parameters": tool.input_schema, "strict": tool.strict}}
            for tool in body.tools
        ]  # fmt: skip
    choice = body.tool_choice
    if choice is not None and (body.tools or choice.type != "none"):
        named = {"type": "function", "function": {"name": choice.name}}
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none", "tool": named}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if body.output_config is not None and body.output_config.format is not None:
        schema = body.output_config.format.schema_
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty, seed=body.seed,
            ignore_eos=body.ignore_eos, priority=body.priority, speculative_decoding=body.speculative_decoding,
            cache_salt=body.cache_salt, structured_outputs=body.structured_outputs,
        )  # fmt: skip
    return ChatCompletionRequest.model_validate({key: value for key, value in fields.items() if value is not None})


def _system_text(system: str | list[TextBlock]) -> str:
    if isinstance(system, str):
        return system
    return _texts(system, "system")


def _texts(blocks: list[TextBlock] | list[ContentBlock], param: str) -> str:
    for index, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise bad_request(
                f"content blocks of type {block.type!r} are not supported here: this model is text-only",
                param=f"{param}.{index}.type",
            )  # fmt: skip
        if block.citations:
            raise bad_request("citations are not supported", param=f"{param}.{index}.citations")
    return "".join(block.text for block in blocks)


def _chat_messages(role: str, content: str | list[ContentBlock], param: str) -> list[dict]:
    """One Anthropic turn as chat messages: a user turn's tool results come first, as tool messages."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    param = f"{param}.content"
    by_type = {"text": [], "tool_use": [], "tool_result": []}
    for index, block in enumerate(content):
        allowed = {"assistant": ("text", "tool_use"), "user": ("text", "tool_result"), "system": ("text",)}[role]
        if block.type not in allowed:
            raise bad_request(f"{role} turns cannot hold content blocks of type {block.type!r}",
                              param=f"{param}.{index}.type")  # fmt: skip
        by_type[block.type].append((index, block))
    text = _texts([block for _, block in by_type["text"]], param) if by_type["text"] else None
    if role == "assistant":
        calls = [_tool_call(block, f"{param}.{index}") for index, block in by_type["tool_use"]]
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    messages = [_tool_message(block, f"{param}.{index}") for index, block in by_type["tool_result"]]
    if text is not None or not messages:
        messages.append({"role": role, "content": text or ""})
    return messages


def _tool_call(block: ContentBlock, param: str) -> dict:
    if block.id is None or block.name is None or block.input is None:
        raise bad_request("a tool_use block needs id, name and input", param=param)
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}}


def _tool_message(block: ContentBlock, param: str) -> dict:
    if block.tool_use_id is None:
        raise bad_request("a tool_result block needs the tool_use_id it answers", param=f"{param}.tool_use_id")
    content = block.content or ""
    text = content if isinstance(content, str) else _texts(content, f"{param}.content")
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": f"Error: {text}" if block.is_error else text}


def _tool_use(call: ToolCall) -> ToolUseOut:
    return ToolUseOut(id=call.id, name=call.name, input=_input_of(call.arguments))


def _input_of(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` is (an object the model wrote, or {} for nothing)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def _usage(generation: Generation, output_tokens: int | None = None) -> MessageUsage:
    """Anthropic's split of the prompt: `input_tokens` are those computed, `cache_read_input_tokens` those the
    prefix cache held (their sum is the prompt, as count_tokens counts it). The cache is automatic: no tokens are
    written at a breakpoint, so `cache_creation_input_tokens` is 0."""
    usage = generation.usage()
    cached = generation.choices[0].num_cached_tokens
    return MessageUsage(
        input_tokens=usage.prompt_tokens - cached, cache_read_input_tokens=cached, cache_creation_input_tokens=0,
        output_tokens=usage.completion_tokens if output_tokens is None else output_tokens,
    )  # fmt: skip


def _stop_reason(finish_reason: str | None, stop_string: str | None) -> str | None:
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string is not None else "end_turn"


async def _events(generation: Generation, tool_plan: ToolPlan) -> AsyncIterator[dict]:
    """Anthropic's stream: message_start; per content block start, deltas (text_delta or input_json_delta), stop;
    message_delta with the stop reason and usage; message_stop. An error after the start is an `error` event."""
    reader = tool_plan.reader()
    index, open_kind, called, stop_string, finish_reason = -1, None, False, None, None
    started = False
    try:
        async for choice, delta in generation.updates():
            if not started:
                # Sent with the first release, which says how much of the prompt the prefix cache held.
                started = True
                start = MessageResponse(id=generation.request_id, model=generation.model, content=[],
                                        stop_reason=None, usage=_usage(generation, output_tokens=0))  # fmt: skip
                yield {"type": "message_start", "message": start.model_dump()}
            content, calls = reader.feed(delta.text, delta.finished)
            if content:
                if open_kind != "text":
                    if open_kind is not None:
                        yield {"type": "content_block_stop", "index": index}
                    index, open_kind = index + 1, "text"
                    yield {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
                yield {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": content}}
            for call in calls:
                if call.id is not None:
                    if open_kind is not None:
                        yield {"type": "content_block_stop", "index": index}
                    index, open_kind, called = index + 1, "tool_use", True
                    block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                    yield {"type": "content_block_start", "index": index, "content_block": block}
                if call.arguments and open_kind == "tool_use":
                    yield {"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": call.arguments}}  # fmt: skip
            if delta.finished:
                finish_reason, stop_string = delta.finish_reason, choice.stop_string
    except Exception as error:
        yield anthropic_error(to_api_error(error))
        return
    if open_kind is not None:
        yield {"type": "content_block_stop", "index": index}
    stop_reason = "tool_use" if called else _stop_reason(finish_reason, stop_string)
    stop_sequence = stop_string if stop_reason == "stop_sequence" else None
    yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
           "usage": _usage(generation).model_dump()}  # fmt: skip
    yield {"type": "message_stop"}
