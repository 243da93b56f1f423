"""POST /v1/completions: the request as the engine's `GenerationRequest`, its choices as OpenAI's response or
stream chunks."""

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.engine import TokenLogprob
from kvserve.engine.request import GenerationRequest
from kvserve.server.context import ServerContext, sampling_params
from kvserve.server.errors import bad_request
from kvserve.server.generation import Choice, Generation, sse_stream
from kvserve.server.logprobs import vllm_prompt_logprobs
from kvserve.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
    random_id,
)
from kvserve.server.structured_outputs import grammar_of
from kvserve.server.supported_fields import check_completion_fields


async def create_completion(body: CompletionRequest, request: Request, ctx: ServerContext):
    ctx.check_known_fields(body)
    lora = ctx.lora_of(body.model)
    ctx.check_generates(body.model)
    check_completion_fields(body)
    prompts = _split_prompts(body.prompt)
    # max_tokens 0 with echo scores the prompt alone (lm-eval's loglikelihood): one token is generated, not returned.
    scores_prompt_only = body.max_tokens == 0 and body.echo
    num_candidates = _num_candidates(body)
    # best_of ranks candidates by their tokens' summed logprobs, so each candidate computes them.
    logprobs = body.logprobs if body.logprobs is not None or num_candidates == body.n else 0
    echoed_logprobs = body.logprobs if body.echo else None
    prompt_logprobs = max((n for n in (echoed_logprobs, body.prompt_logprobs) if n is not None), default=None)
    params = sampling_params(
        body, max_tokens=1 if scores_prompt_only else body.max_tokens, logprobs=logprobs, grammar=grammar_of(body),
        prompt_logprobs=prompt_logprobs,
    )  # fmt: skip
    engine_request = GenerationRequest(prompts, params, num_candidates, body.cache_salt, lora, body.priority)
    generation = await Generation.start(
        ctx.engine, engine_request, random_id("cmpl"), ctx.count_disconnect, ctx.response_model(lora)
    )
    echoes = [_echo_text(ctx, body, prompt) for prompt in prompts]
    if body.stream:
        chunks = _stream_chunks(body, ctx, generation, echoes, scores_prompt_only)
        return StreamingResponse(sse_stream(chunks, generation), media_type="text/event-stream")

    await generation.run_to_end(request)
    choices = []
    for index, choice in enumerate(_best_of(generation.choices, num_candidates, body.n)):
        if scores_prompt_only:
            choice.drop_output()
        prefix = echoes[choice.index // num_candidates]
        logprobs = None
        if body.logprobs is not None:
            logprobs = _echoed_prompt_logprobs(ctx, body, generation, choice, choice.prompt_logprobs)
            _append_logprobs(logprobs, choice.logprobs or [], len(prefix), body.logprobs)
        prompt_logprobs = vllm_prompt_logprobs(body.prompt_logprobs, choice.prompt_logprobs)
        choices.append(CompletionChoice(index=index, text=prefix + choice.text, logprobs=logprobs,
                                        finish_reason=choice.finish_reason,
                                        prompt_logprobs=prompt_logprobs))  # fmt: skip
    usage = generation.usage()
    response = CompletionResponse(
        id=generation.request_id, created=generation.created, model=generation.model, choices=choices,
        usage=Usage.of(usage.prompt_tokens, 0) if scores_prompt_only else usage,
    )  # fmt: skip
    return JSONResponse(response.model_dump())


def _num_candidates(body: CompletionRequest) -> int:
    """How many sequences each prompt samples: `best_of` (returning the `n` best) or `n` (the engine caps both)."""
    if body.best_of is None or body.best_of == body.n:
        return body.n
    if body.best_of < body.n:
        raise bad_request(f"best_of ({body.best_of}) must be at least n ({body.n})", param="best_of")
    if body.stream:
        raise bad_request("best_of cannot be streamed: the best candidates are known only at the end", param="best_of")
    return body.best_of


def _best_of(choices: list[Choice], num_candidates: int, n: int) -> list[Choice]:
    """Each prompt's `n` candidates with the highest summed token logprob, best first."""
    if num_candidates == n:
        return choices
    best = []
    for first in range(0, len(choices), num_candidates):
        candidates = choices[first : first + num_candidates]
        candidates.sort(key=lambda choice: sum(entry.logprob for entry in choice.logprobs), reverse=True)
        best += candidates[:n]
    return best


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
    return ctx.engine.decode(prompt, skip_special_tokens=body.skip_special_tokens)


async def _stream_chunks(
    body: CompletionRequest, ctx: ServerContext, generation: Generation, echoes: list[str], scores_prompt_only: bool
) -> AsyncIterator[CompletionChunk]:
    """The echoed prompt (with its logprobs) comes with each choice's first chunk."""
    text_offsets: dict[int, int] = {}
    async for choice, delta in generation.updates():
        first = choice.index not in text_offsets
        text = echoes[choice.index // body.n] if first else ""
        offset = text_offsets.get(choice.index, 0) + len(text)
        logprobs = None
        if body.logprobs is not None:
            prompt_entries = delta.prompt_logprobs if first else None
            logprobs = _echoed_prompt_logprobs(ctx, body, generation, choice, prompt_entries)
            _append_logprobs(logprobs, [] if scores_prompt_only else delta.logprobs or [], offset, body.logprobs)
        if not scores_prompt_only:
            text += delta.text
        text_offsets[choice.index] = text_offsets.get(choice.index, 0) + len(text)
        chunk_choice = CompletionChunkChoice(index=choice.index, text=text, logprobs=logprobs,
                                             finish_reason=delta.finish_reason)  # fmt: skip
        yield CompletionChunk(id=generation.request_id, created=generation.created, model=generation.model,
                              choices=[chunk_choice])  # fmt: skip
    if body.stream_options is not None and body.stream_options.include_usage:
        usage = generation.usage()
        yield CompletionChunk(
            id=generation.request_id, created=generation.created, model=generation.model, choices=[],
            usage=Usage.of(usage.prompt_tokens, 0) if scores_prompt_only else usage,
        )  # fmt: skip


def _echoed_prompt_logprobs(
    ctx: ServerContext, body: CompletionRequest, generation: Generation, choice: Choice,
    entries: list[TokenLogprob | None] | None,
) -> CompletionLogprobs:  # fmt: skip
    """With echo, the prompt's tokens lead the logprobs; its first token has none (nothing scores it)."""
    result = CompletionLogprobs()
    if not body.echo or entries is None:
        return result
    offset = 0
    for token_id, entry in zip(generation.prompt_token_ids(choice), entries, strict=True):
        if entry is None:  # the first token: nothing scores it
            token = ctx.engine.token_text(token_id)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            token = entry.token
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append(_top(entry, body.logprobs))
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def _append_logprobs(
    result: CompletionLogprobs, entries: list[TokenLogprob], first_offset: int, num_top: int
) -> CompletionLogprobs:
    offset = first_offset
    for entry in entries:
        result.tokens.append(entry.token)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append(_top(entry, num_top))
        result.text_offset.append(offset)
        offset += len(entry.token)
    return result


def _top(entry: TokenLogprob, num_top: int) -> dict[str, float]:
    top: dict[str, float] = {}
    for text, (_, logprob) in zip(entry.top_tokens[:num_top], entry.top_logprobs[:num_top], strict=True):
        top.setdefault(text, logprob)  # tokens that read alike keep the likeliest
    return top
