"""POST /v1/chat/completions: the request as the engine's `GenerationRequest` (messages as a `ChatPrompt` the
engine renders with the chat template), its choices as OpenAI's response or stream chunks."""

import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.engine import TokenLogprob
from kvserve.engine.request import ChatPrompt, GenerationRequest
from kvserve.engine.sampling_params import MAX_LOGPROBS
from kvserve.server.context import ServerContext, sampling_params
from kvserve.server.errors import bad_request
from kvserve.server.generation import Choice, Generation, sse_stream
from kvserve.server.logprobs import vllm_prompt_logprobs
from kvserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ToolCallDeltaOut,
    ToolCallFunction,
    ToolCallFunctionDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
    random_id,
)
from kvserve.server.structured_outputs import grammar_of
from kvserve.server.supported_fields import check_chat_fields
from kvserve.server.tool_calling import ToolPlan, plan_tools
from kvserve.server.tool_parsers import ToolCallDelta


def chat_prompt(
    messages: list[ChatMessage], add_generation_prompt: bool, tools: list[dict] | None = None
) -> ChatPrompt:
    """The conversation as the engine's input processor renders it with the chat template."""
    conversation = [_template_message(message, index) for index, message in enumerate(messages)]
    return ChatPrompt(conversation, tools, add_generation_prompt)


def _template_message(message: ChatMessage, index: int) -> dict:
    """A message as chat templates take it: text content, and tool calls with their arguments as objects."""
    param = f"messages.{index}"
    if message.role == "tool" and message.tool_call_id is None:
        raise bad_request("a tool message needs the tool_call_id it answers", param=f"{param}.tool_call_id")
    if message.tool_calls is not None and message.role != "assistant":
        raise bad_request("only assistant messages have tool_calls", param=f"{param}.tool_calls")
    result = {"role": message.role, "content": _text(message.content, param)}
    if message.name is not None:
        result["name"] = message.name
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        result["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments, param)}}
            for call in message.tool_calls
        ]  # fmt: skip
    return result


def _text(content, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for index, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"content parts of type {part.type!r} are not supported: this model is text-only",
                param=f"{param}.content.{index}.type",
            )  # fmt: skip
    return "".join(part.text for part in content)


def _arguments(arguments: str, param: str) -> dict:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise bad_request("tool call arguments must be the JSON text of an object", param=f"{param}.tool_calls")
    return value


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: ServerContext):
    ctx.check_known_fields(body)
    generation, tool_plan = await start_chat(body, ctx, random_id("chatcmpl"))
    if body.stream:
        chunks = _stream_chunks(body, ctx, generation, tool_plan)
        return StreamingResponse(sse_stream(chunks, generation), media_type="text/event-stream")

    await generation.run_to_end(request)
    choices = [_choice(choice, tool_plan) for choice in generation.choices]
    response = ChatCompletionResponse(
        id=generation.request_id, created=generation.created, model=generation.model, choices=choices,
        usage=generation.usage(),
        prompt_logprobs=vllm_prompt_logprobs(body.prompt_logprobs, generation.choices[0].prompt_logprobs),
    )  # fmt: skip
    payload = response.model_dump()
    if payload["prompt_logprobs"] is None:
        del payload["prompt_logprobs"]
    for choice in payload["choices"]:
        if choice["message"]["tool_calls"] is None:
            del choice["message"]["tool_calls"]
    return JSONResponse(payload)


async def start_chat(body: ChatCompletionRequest, ctx: ServerContext, request_id: str) -> tuple[Generation, ToolPlan]:
    """Check a chat request (or another protocol's, translated into one) and queue it in the engine: the requests
    and the plan that reads tool calls back out of their output."""
    lora = ctx.lora_of(body.model)
    ctx.check_generates(body.model)
    check_chat_fields(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        # Checked here, as the engine would name its own field, `logprobs`.
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", param="top_logprobs")
    tool_plan = plan_tools(body, ctx.settings.tool_call_parser)
    grammar = grammar_of(body)
    if tool_plan.grammar is not None and grammar is not None:
        raise bad_request("a forced tool call cannot be combined with response_format", param="tool_choice")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, grammar=grammar or tool_plan.grammar)
    prompt = chat_prompt(body.messages, body.add_generation_prompt, tool_plan.template_tools)
    engine_request = GenerationRequest([prompt], params, body.n, body.cache_salt, lora, body.priority)
    generation = await Generation.start(
        ctx.engine, engine_request, request_id, ctx.count_disconnect, ctx.response_model(lora)
    )
    return generation, tool_plan


def _choice(choice: Choice, tool_plan: ToolPlan) -> ChatChoice:
    parsed = tool_plan.parse(choice.text)
    calls = parsed.tool_calls
    message = ChatResponseMessage(
        content=parsed.content,
        tool_calls=[ToolCallOut(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments)) for c in calls]
        or None,
    )
    return ChatChoice(
        index=choice.index, message=message, finish_reason=_finish_reason(choice.finish_reason, bool(calls)),
        logprobs=chat_logprobs(choice.logprobs) if choice.logprobs is not None else None,
    )  # fmt: skip


def _finish_reason(reason: str | None, called_tools: bool) -> str | None:
    return "tool_calls" if called_tools and reason == "stop" else reason


async def _stream_chunks(
    body: ChatCompletionRequest, ctx: ServerContext, generation: Generation, tool_plan: ToolPlan
) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=generation.request_id, created=generation.created, model=generation.model,
                                   choices=choices, usage=usage)  # fmt: skip

    readers = {choice.index: tool_plan.reader() for choice in generation.choices}
    called_tools: set[int] = set()
    for choice in generation.choices:
        yield chunk([ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))])
    async for choice, delta in generation.updates():
        content, calls = readers[choice.index].feed(delta.text, delta.finished)
        if calls:
            called_tools.add(choice.index)
        message = ChatDelta(content=content or None, tool_calls=[_call_delta(call) for call in calls] or None)
        finish_reason = _finish_reason(delta.finish_reason, choice.index in called_tools)
        logprobs = chat_logprobs(delta.logprobs) if delta.logprobs is not None else None
        yield chunk([ChatChunkChoice(index=choice.index, delta=message, logprobs=logprobs,
                                     finish_reason=finish_reason)])  # fmt: skip
    if body.stream_options is not None and body.stream_options.include_usage:
        yield chunk([], generation.usage())


def _call_delta(call: ToolCallDelta) -> ToolCallDeltaOut:
    if call.id is None:
        return ToolCallDeltaOut(index=call.index, function=ToolCallFunctionDelta(arguments=call.arguments))
    function = ToolCallFunctionDelta(name=call.name, arguments=call.arguments)
    return ToolCallDeltaOut(index=call.index, id=call.id, type="function", function=function)


def chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
    def top(token: str, logprob: float) -> TopLogprob:
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    content = []
    for entry in entries:
        alternatives = [top(text, lp) for text, (_, lp) in zip(entry.top_tokens, entry.top_logprobs, strict=True)]
        content.append(ChatTokenLogprob(**top(entry.token, entry.logprob).model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)
