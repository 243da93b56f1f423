"""POST /v1/responses (OpenAI's Responses API): the request translated into a chat request (its input items as
messages, `instructions` as the system message, `text.format` as the response format, function tools as tools),
generated as chat is, and its output returned as output items: one message, then the function calls the tool parser
reads out of the text. Stored responses (`store`, the default) can be continued with `previous_response_id`.

Built-in tools (web search, file search, computer use, ...), background runs, conversations, prompt templates and
reasoning are refused by name; so is every input item or content part other than text and function calls.
"""

import dataclasses
import itertools
from collections.abc import AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kvserve.server.chat import chat_logprobs, start_chat
from kvserve.server.context import ServerContext
from kvserve.server.errors import bad_request, renamed_params, to_api_error
from kvserve.server.generation import Generation, event_stream
from kvserve.server.protocol import ChatCompletionRequest, now_s, random_id
from kvserve.server.response_store import ResponseStore
from kvserve.server.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    InputContent,
    InputItem,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from kvserve.server.tool_calling import ToolPlan
from kvserve.server.tool_parsers import ToolCall

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Asks for the encrypted reasoning of reasoning items; the model does not reason, so there are none to fill (the
# Codex CLI sends it on every turn).
REASONING_INCLUDE = "reasoning.encrypted_content"
_REFUSED_FIELDS = {
    "background": "background responses are not supported; leave `background` unset or false",
    "background_options": "background responses are not supported",
    "conversation": "conversations are not supported; continue a response with previous_response_id",
    "prompt": "prompt templates are not supported; send `input` and `instructions`",
    "moderation": "moderation is not supported",
    "image": "image generation is not supported: this model is text-only",
    "access_programs": "access programs are not supported",
    "context_management": "context management (compaction) is not supported",
    "prompt_cache_options": "prompt cache options are not supported: the prefix cache is automatic and has no TTL",
    "prompt_cache_retention": "prompt cache retention is not supported: the prefix cache is automatic and has no TTL",
}
# What a request's errors name when they come from the chat request it became.
_CHAT_TO_RESPONSES_PARAMS = {
    "messages": "input", "prompt": "input", "max_tokens": "max_output_tokens", "max_completion_tokens":
    "max_output_tokens", "response_format": "text.format", "response_format.json_schema.schema": "text.format.schema",
    "logprobs": "top_logprobs",
}  # fmt: skip


async def create_response(body: ResponsesRequest, request: Request, ctx: ServerContext, store: ResponseStore):
    ctx.check_known_fields(body)
    _check_fields(body)
    previous = []
    if body.previous_response_id is not None:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise bad_request(
                f"previous response {body.previous_response_id!r} is not stored (never, expired, or deleted)",
                param="previous_response_id",
            )  # fmt: skip
        previous = stored.conversation
    conversation = previous + _messages_of(body)
    chat_body = _chat_request(body, conversation)
    with renamed_params(_CHAT_TO_RESPONSES_PARAMS):
        generation, tool_plan = await start_chat(chat_body, ctx, random_id("resp"))
    if body.max_tool_calls is not None:
        # A response returns at most this many function calls: the first ones the parser reads.
        max_calls = min(body.max_tool_calls, tool_plan.max_calls or body.max_tool_calls)
        tool_plan = dataclasses.replace(tool_plan, max_calls=max_calls)
    draft = _ResponseDraft(body, generation, conversation)
    if body.stream:
        return StreamingResponse(
            event_stream(_events(draft, tool_plan, store), generation), media_type="text/event-stream"
        )
    await generation.run_to_end(request)
    choice = generation.choices[0]
    parsed = tool_plan.parse(choice.text)
    if parsed.content:
        logprobs = chat_logprobs(choice.logprobs).content if draft.wants_logprobs and choice.logprobs else []
        draft.add_message(parsed.content, [entry.model_dump() for entry in logprobs])
    for call in parsed.tool_calls:
        draft.add_call(call)
    response = draft.finish(choice.finish_reason)
    draft.keep(response, store)
    return JSONResponse(response.model_dump())


def _check_fields(body: ResponsesRequest) -> None:
    for name, reason in _REFUSED_FIELDS.items():
        if getattr(body, name) not in (None, False):
            raise bad_request(reason, param=name)
    if body.input is None and body.previous_response_id is None:
        raise bad_request("input is required", param="input")
    if body.service_tier not in (None, "auto", "default"):
        raise bad_request(f"service_tier {body.service_tier!r} is not supported; use 'auto'", param="service_tier")
    if body.truncation == "auto":
        raise bad_request(
            'truncation "auto" (dropping the oldest turns to fit) is not supported; too long an input is a 400',
            param="truncation",
        )  # fmt: skip
    # A summary of the reasoning is asked for by agents on every turn (Codex CLI): with no reasoning, there is none.
    if body.reasoning is not None and body.reasoning.effort not in (None, "none"):
        message = "this model does not reason: only reasoning effort 'none' is served"
        raise bad_request(message, param="reasoning.effort")
    if body.text is not None and body.text.verbosity is not None:
        raise bad_request("`text.verbosity` is not supported", param="text.verbosity")
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise bad_request("stream obfuscation is not supported", param="stream_options.include_obfuscation")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options needs stream: true", param="stream_options")
    for index, name in enumerate(body.include or []):
        if name not in (LOGPROBS_INCLUDE, REASONING_INCLUDE):
            raise bad_request(f"include {name!r} is not supported", param=f"include.{index}")
    for index, tool in enumerate(body.tools or []):
        if tool.type != "function":
            message = f"{tool.type!r} tools are not supported: only function tools"
            raise bad_request(message, param=f"tools.{index}.type")
        if tool.name is None:
            raise bad_request("a function tool needs a name", param=f"tools.{index}.name")
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str) and (choice.type != "function" or choice.name is None):
        raise bad_request(
            f"tool_choice of type {choice.type!r} is not supported: give none, auto, required or a function's name",
            param="tool_choice",
        )  # fmt: skip


def _messages_of(body: ResponsesRequest) -> list[dict]:
    """The input items as chat messages: consecutive function calls become one assistant message's tool calls."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict] = []
    for index, item in enumerate(body.input):
        param = f"input.{index}"
        if item.type == "message":
            messages.append(_message(item, param))
        elif item.type == "function_call":
            call = {"id": _required(item.call_id, f"{param}.call_id"), "type": "function",
                    "function": {"name": _required(item.name, f"{param}.name"),
                                 "arguments": _required(item.arguments, f"{param}.arguments")}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not _answered(messages, last):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            output = _required(item.output, f"{param}.output")
            content = output if isinstance(output, str) else _text(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": _required(item.call_id, f"{param}.call_id"),
                             "content": content})  # fmt: skip
        else:
            raise bad_request(f"input items of type {item.type!r} are not supported", param=f"{param}.type")
    return messages


def _answered(messages: list[dict], assistant: dict) -> bool:
    return messages[-1] is not assistant


def _message(item: InputItem, param: str) -> dict:
    if item.role is None:
        raise bad_request("a message needs a role", param=f"{param}.role")
    content = _required(item.content, f"{param}.content")
    text = content if isinstance(content, str) else _text(content, f"{param}.content")
    return {"role": item.role, "content": text}


def _text(parts: list[InputContent], param: str) -> str:
    for index, part in enumerate(parts):
        if part.type not in InputContent.SERVED_TYPES or part.text is None:
            raise bad_request(
                f"content parts of type {part.type!r} are not supported: this model is text-only",
                param=f"{param}.{index}.type",
            )  # fmt: skip
    return "".join(part.text for part in parts)


def _required(value, param: str):
    if value is None:
        raise bad_request(f"{param} is required", param=param)
    return value


def _chat_request(body: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else []) + [
        dict(message) for message in conversation
    ]
    fields = {
        "model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty, "seed": body.seed, "stop": body.stop,
        "ignore_eos": body.ignore_eos, "priority": body.priority, "speculative_decoding": body.speculative_decoding,
        "cache_salt": body.cache_salt, "parallel_tool_calls": body.parallel_tool_calls,
        "structured_outputs": body.structured_outputs,
    }  # fmt: skip
    if LOGPROBS_INCLUDE in (body.include or []):
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    elif body.top_logprobs:
        raise bad_request(f"top_logprobs needs include [{LOGPROBS_INCLUDE!r}]", param="top_logprobs")
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]  # fmt: skip
    if isinstance(body.tool_choice, str):
        fields["tool_choice"] = body.tool_choice
    elif body.tool_choice is not None:
        fields["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        schema = {"name": text_format.name or "response", "schema": text_format.schema_, "strict": text_format.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif text_format is not None:
        fields["response_format"] = {"type": text_format.type}
    try:
        return ChatCompletionRequest.model_validate({key: value for key, value in fields.items() if value is not None})
    except ValidationError as error:  # a value the Responses model passed and chat's does not
        first = error.errors()[0]
        raise bad_request(f"{first['msg']} ({'.'.join(map(str, first['loc']))})") from None


class _ResponseDraft:
    """A response's output items as they are made (streamed or not), then the response object and what is stored."""

    def __init__(self, body: ResponsesRequest, generation: Generation, conversation: list[dict]) -> None:
        self.body = body
        self.generation = generation
        self.conversation = conversation
        self.output: list[OutputMessage | FunctionCallItem] = []
        self.created_at = now_s()
        self.wants_logprobs = LOGPROBS_INCLUDE in (body.include or [])

    def response(self, status: str, usage: ResponseUsage | None = None, finish_reason: str | None = None):
        body = self.body
        incomplete = IncompleteDetails(reason="max_output_tokens") if finish_reason == "length" else None
        tool_choice = body.tool_choice if body.tool_choice is not None else "auto"
        text_format = body.text.format if body.text is not None and body.text.format is not None else None
        text = {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}}
        return ResponseObject(
            id=self.generation.request_id, created_at=self.created_at, status=status,
            incomplete_details=incomplete, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            max_tool_calls=body.max_tool_calls, model=self.generation.model, output=list(self.output),
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id, store=body.store is not False,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_logprobs=body.top_logprobs or 0,
            text=text,
            tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(exclude_none=True),
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []], usage=usage,
            user=body.user, metadata=body.metadata or {},
        )  # fmt: skip

    def add_message(self, text: str, logprobs: list[dict]) -> OutputMessage:
        message = OutputMessage(id=random_id("msg"), status="completed",
                                content=[OutputText(text=text, logprobs=logprobs)])  # fmt: skip
        self.output.append(message)
        return message

    def add_call(self, call: ToolCall) -> FunctionCallItem:
        item = FunctionCallItem(id=random_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments,
                                status="completed")  # fmt: skip
        self.output.append(item)
        return item

    def finish(self, finish_reason: str | None) -> ResponseObject:
        if finish_reason == "length" and self.output:
            self.output[-1].status = "incomplete"
        usage = self.generation.usage()
        cached = InputTokensDetails(cached_tokens=self.generation.choices[0].num_cached_tokens)
        response_usage = ResponseUsage(
            input_tokens=usage.prompt_tokens, input_tokens_details=cached, output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        )  # fmt: skip
        status = "incomplete" if finish_reason == "length" else "completed"
        return self.response(status, response_usage, finish_reason)

    def keep(self, response: ResponseObject, store: ResponseStore) -> None:
        if self.body.store is False:
            return
        store.put(response.model_dump(), [*self.conversation, self._assistant_turn()])

    def _assistant_turn(self) -> dict:
        text = "".join(part.text for item in self.output if isinstance(item, OutputMessage) for part in item.content)
        calls = [
            {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            for item in self.output
            if isinstance(item, FunctionCallItem)
        ]
        return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


async def _events(draft: _ResponseDraft, tool_plan: ToolPlan, store: ResponseStore) -> AsyncIterator[dict]:
    """The Responses stream's typed events, in order: created, in_progress; per output item added, its deltas, done;
    then completed (or incomplete, at max_output_tokens). An error after the start is an `error` event."""
    sequence = itertools.count()

    def event(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(sequence), **fields}

    generation = draft.generation
    yield event("response.created", response=draft.response("in_progress").model_dump())
    yield event("response.in_progress", response=draft.response("in_progress").model_dump())
    reader = tool_plan.reader()
    open_item: OutputMessage | FunctionCallItem | None = None
    pending_logprobs: list[dict] = []
    finish_reason = None
    try:
        async for _, delta in generation.updates():
            content, calls = reader.feed(delta.text, delta.finished)
            if draft.wants_logprobs and content == delta.text and delta.logprobs:
                # Tokens whose text is empty (held back, or a skipped special token) send their logprobs with the
                # next text, or alone once the message is open, so the stream carries every token's.
                pending_logprobs += [entry.model_dump() for entry in chat_logprobs(delta.logprobs).content]
            if content or (pending_logprobs and isinstance(open_item, OutputMessage)):
                if not isinstance(open_item, OutputMessage):
                    for closing in _close(open_item, event, len(draft.output) - 1):
                        yield closing
                    open_item = draft.add_message("", [])
                    open_item.status = "in_progress"
                    yield event("response.output_item.added", output_index=len(draft.output) - 1,
                                item={**open_item.model_dump(), "content": []})  # fmt: skip
                    yield event("response.content_part.added", item_id=open_item.id, output_index=len(draft.output) - 1,
                                content_index=0, part=OutputText(text="").model_dump())  # fmt: skip
                part = open_item.content[0]
                part.text += content
                part.logprobs += pending_logprobs
                yield event("response.output_text.delta", item_id=open_item.id, output_index=len(draft.output) - 1,
                            content_index=0, delta=content, logprobs=pending_logprobs)  # fmt: skip
                pending_logprobs = []
            for call in calls:
                if call.id is not None:
                    for closing in _close(open_item, event, len(draft.output) - 1):
                        yield closing
                    open_item = draft.add_call(ToolCall(call.id, call.name or "", ""))
                    open_item.status = "in_progress"
                    yield event("response.output_item.added", output_index=len(draft.output) - 1,
                                item=open_item.model_dump())  # fmt: skip
                if call.arguments and isinstance(open_item, FunctionCallItem):
                    open_item.arguments += call.arguments
                    yield event("response.function_call_arguments.delta", item_id=open_item.id,
                                output_index=len(draft.output) - 1, delta=call.arguments)  # fmt: skip
            finish_reason = delta.finish_reason if delta.finished else finish_reason
    except Exception as error:
        api_error = to_api_error(error)
        yield event("error", code=api_error.code or api_error.type, message=api_error.message, param=api_error.param)
        return
    last_status = "incomplete" if finish_reason == "length" else "completed"
    for closing in _close(open_item, event, len(draft.output) - 1, last_status):
        yield closing
    response = draft.finish(finish_reason)
    draft.keep(response, store)
    kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
    yield event(kind, response=response.model_dump())


def _close(
    item: OutputMessage | FunctionCallItem | None, event, output_index: int, status: str = "completed"
) -> Iterator[dict]:
    if item is None:
        return
    item.status = status
    if isinstance(item, OutputMessage):
        part = item.content[0]
        yield event("response.output_text.done", item_id=item.id, output_index=output_index, content_index=0,
                    text=part.text, logprobs=part.logprobs)  # fmt: skip
        yield event("response.content_part.done", item_id=item.id, output_index=output_index, content_index=0,
                    part=part.model_dump())  # fmt: skip
    else:
        yield event("response.function_call_arguments.done", item_id=item.id, output_index=output_index,
                    arguments=item.arguments)  # fmt: skip
    yield event("response.output_item.done", output_index=output_index, item=item.model_dump())
