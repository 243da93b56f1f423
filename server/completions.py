"""POST /v1/completions."""

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import TokenLogprob
from server.context import ServerContext
from server.errors import bad_request
from server.generation import Generation, sse_stream
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)


async def create_completion(body: CompletionRequest, request: Request, ctx: ServerContext):
    ctx.check_model(body.model)
    if body.echo and body.logprobs is not None:
        raise bad_request("echo together with logprobs (prompt logprobs) is not supported", param="echo")
    raw_prompts = _split_prompts(body.prompt)
    if len(raw_prompts) > ctx.settings.max_prompts:
        raise bad_request(f"at most {ctx.settings.max_prompts} prompts, got {len(raw_prompts)}", param="prompt")
    prompts = [ctx.engine.engine.tokenize_prompt(prompt) for prompt in raw_prompts]
    echoes = [_echo_text(ctx, body, prompt) for prompt in raw_prompts]
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = ctx.max_model_len - max(len(p) for p in prompts)
    params = ctx.sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs)

    generation = Generation(ctx.engine, random_id("cmpl"), ctx.model_name, ctx.count_disconnect)
    generation.submit(prompts, params, body.n)
    if body.stream:
        chunks = _stream_chunks(body, ctx, generation, echoes)
        return StreamingResponse(sse_stream(chunks, generation), media_type="text/event-stream")

    await generation.run_to_end(request)
    choices = []
    for choice in generation.choices:
        prefix = echoes[choice.index // body.n]
        logprobs = _logprobs(ctx, choice.logprobs, len(prefix)) if choice.logprobs is not None else None
        choices.append(CompletionChoice(index=choice.index, text=prefix + choice.text, logprobs=logprobs,
                                        finish_reason=choice.finish_reason))  # fmt: skip
    response = CompletionResponse(
        id=generation.request_id, created=generation.created, model=ctx.model_name, choices=choices,
        usage=generation.usage(),
    )  # fmt: skip
    return JSONResponse(response.model_dump())


def _split_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    return list(prompt)


def _echo_text(ctx: ServerContext, body: CompletionRequest, prompt: str | list[int]) -> str:
    """What echo prepends: a text prompt as given (without the BOS its encoding adds), token ids decoded."""
    if not body.echo:
        return ""
    if isinstance(prompt, str):
        return prompt
    return ctx.tokenizer.decode(prompt, skip_special_tokens=body.skip_special_tokens)


async def _stream_chunks(
    body: CompletionRequest, ctx: ServerContext, generation: Generation, echoes: list[str]
) -> AsyncIterator[dict]:
    object_name = "text_completion"
    text_offsets = {}
    if body.echo:
        for choice in generation.choices:
            prefix = echoes[choice.index // body.n]
            yield generation.chunk(object_name, [{"index": choice.index, "text": prefix, "logprobs": None,
                                                  "finish_reason": None}])  # fmt: skip
    async for choice, delta in generation.deltas():
        logprobs = None
        if delta.logprobs is not None:
            offset = text_offsets.get(choice.index, 0)
            logprobs = _logprobs(ctx, delta.logprobs, offset)
            text_offsets[choice.index] = offset + sum(len(t) for t in logprobs.tokens)
            logprobs = logprobs.model_dump()
        yield generation.chunk(object_name, [{"index": choice.index, "text": delta.text, "logprobs": logprobs,
                                              "finish_reason": delta.finish_reason}])  # fmt: skip
    if body.stream_options is not None and body.stream_options.include_usage:
        yield generation.chunk(object_name, [], generation.usage())


def _logprobs(ctx: ServerContext, entries: list[TokenLogprob], first_offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    offset = first_offset
    for entry in entries:
        token = ctx.token_text(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        top: dict[str, float] = {}
        for token_id, logprob in entry.top_logprobs:  # most likely first
            top.setdefault(ctx.token_text(token_id), logprob)  # tokens that read alike keep the likeliest
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(token)
    return result
