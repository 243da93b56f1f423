"""POST /v1/chat/completions."""

from collections.abc import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import TokenLogprob
from engine.sampling_params import MAX_LOGPROBS
from server.context import ServerContext
from server.errors import bad_request
from server.generation import Generation, sse_stream
from server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
    random_id,
)


def render_chat_prompt(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """Apply the chat template (the server's override, else the tokenizer's) and tokenize."""
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    template = ctx.chat_template or ctx.tokenizer.chat_template
    if template is None:
        raise bad_request("this model has no chat template; start the server with --chat-template", param="messages")
    conversation = [{"role": m.role, "content": _text(m.content)} for m in messages]
    try:
        text = ctx.tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except jinja2.TemplateError as error:
        raise bad_request(f"the chat template rejected these messages: {error}", param="messages") from None
    # The template writes any BOS it wants; encoding must not add a second one.
    return ctx.tokenizer.encode(text, add_special_tokens=False)


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: ServerContext):
    ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        # Checked here, as the engine would name its own field, `logprobs`.
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", param="top_logprobs")
    prompt = ctx.engine.engine.tokenize_prompt(render_chat_prompt(ctx, body.messages, body.add_generation_prompt))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = ctx.max_model_len - len(prompt)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = ctx.sampling_params(body, max_tokens=max_tokens, logprobs=logprobs)

    generation = Generation(ctx.engine, random_id("chatcmpl"), ctx.model_name, ctx.count_disconnect)
    generation.submit([prompt], params, body.n)
    if body.stream:
        chunks = _stream_chunks(body, ctx, generation)
        return StreamingResponse(sse_stream(chunks, generation), media_type="text/event-stream")

    await generation.run_to_end(request)
    choices = [
        ChatChoice(
            index=choice.index,
            message=ChatResponseMessage(content=choice.text),
            logprobs=_logprobs(ctx, choice.logprobs) if choice.logprobs is not None else None,
            finish_reason=choice.finish_reason,
        )
        for choice in generation.choices
    ]
    response = ChatCompletionResponse(
        id=generation.request_id, created=generation.created, model=ctx.model_name, choices=choices,
        usage=generation.usage(),
    )  # fmt: skip
    return JSONResponse(response.model_dump())


async def _stream_chunks(
    body: ChatCompletionRequest, ctx: ServerContext, generation: Generation
) -> AsyncIterator[dict]:
    object_name = "chat.completion.chunk"
    for choice in generation.choices:
        delta = {"role": "assistant", "content": ""}
        yield generation.chunk(object_name, [{"index": choice.index, "delta": delta, "logprobs": None,
                                              "finish_reason": None}])  # fmt: skip
    async for choice, delta in generation.deltas():
        logprobs = _logprobs(ctx, delta.logprobs).model_dump() if delta.logprobs is not None else None
        content = {"content": delta.text} if delta.text else {}
        yield generation.chunk(object_name, [{"index": choice.index, "delta": content, "logprobs": logprobs,
                                              "finish_reason": delta.finish_reason}])  # fmt: skip
    if body.stream_options is not None and body.stream_options.include_usage:
        yield generation.chunk(object_name, [], generation.usage())


def _logprobs(ctx: ServerContext, entries: list[TokenLogprob]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        token = ctx.token_text(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    content = []
    for entry in entries:
        sampled = top(entry.token_id, entry.logprob)
        alternatives = [top(t, lp) for t, lp in entry.top_logprobs]
        content.append(ChatTokenLogprob(**sampled.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)
