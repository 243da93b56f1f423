"""What completions and chat share: one request's choices as the engine streams them, usage, SSE framing."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import BaseModel

from kvserve.engine import RequestDelta, TokenLogprob
from kvserve.engine.async_engine import AsyncLLMEngine, GenerationStream
from kvserve.engine.request import GenerationRequest
from kvserve.server.errors import APIError, to_api_error
from kvserve.server.protocol import Usage, now_s

DISCONNECT_POLL_S = 0.25


@dataclass
class Choice:
    """One generated sequence (prompt index x n): what the engine has released of it so far."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it, if one did
    num_cached_tokens: int = 0  # of its prompt's tokens, those the prefix cache held
    embedding: list[float] | None = None  # an embedding request's vector
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, delta: RequestDelta) -> None:
        self.token_ids += delta.token_ids
        self.text_parts.append(delta.text)
        if delta.logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs += delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finish_reason = delta.finish_reason
        self.stop_string = delta.stop_string
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.embedding is not None:
            self.embedding = delta.embedding

    def drop_output(self) -> None:
        """Forget the generated tokens (a request that only scores its prompt generates one, not returned)."""
        self.token_ids, self.text_parts, self.logprobs = [], [], None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Generation:
    """One API request's choices: queued in the engine together, read together, aborted together."""

    def __init__(
        self, stream: GenerationStream, request_id: str, on_disconnect: Callable[[], None], model: str
    ) -> None:
        """`model`: the name responses give (the base model's, or the LoRA adapter's)."""
        self.request_id = request_id
        self.model = model
        self.created = now_s()
        self.on_disconnect = on_disconnect
        self.processed = stream.processed
        self.choices = [Choice(index) for index in range(stream.processed.num_choices)]
        self._stream = stream

    @classmethod
    async def start(
        cls, engine: AsyncLLMEngine, request: GenerationRequest, request_id: str, on_disconnect: Callable[[], None],
        model: str,
    ) -> "Generation":  # fmt: skip
        """Check and queue the request in the engine (its errors are the API's 400, 429 and 503)."""
        return cls(await engine.generate(request, request_id), request_id, on_disconnect, model)

    def abort(self) -> None:
        self._stream.abort()

    async def updates(self) -> AsyncIterator[tuple[Choice, RequestDelta]]:
        """Each choice with its delta every time it has new output, until all are finished; aborts on exit."""
        async for index, delta in self._stream:
            choice = self.choices[index]
            choice.add(delta)
            yield choice, delta

    def prompt_token_ids(self, choice: Choice) -> list[int]:
        return self.processed.prompt_of(choice.index)

    def usage(self) -> Usage:
        """Each prompt's tokens once (whatever n is), and every choice's generated tokens."""
        completion_tokens = sum(len(choice.token_ids) for choice in self.choices)
        return Usage.of(sum(map(len, self.processed.prompt_token_ids)), completion_tokens)

    async def run_to_end(self, request: Request) -> None:
        """Wait for every choice to finish; if the client goes away first, abort and count it."""

        async def consume() -> None:
            async for _ in self.updates():
                pass

        consumer = asyncio.create_task(consume())
        watcher = asyncio.create_task(_wait_for_disconnect(request))
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer in done:
            watcher.cancel()
            consumer.result()
            return
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        self.on_disconnect()
        raise APIError(499, "client disconnected", type="client_closed_request")


async def _wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def sse(payload: BaseModel | str) -> str:
    return f"data: {payload if isinstance(payload, str) else payload.model_dump_json()}\n\n"


async def sse_stream(chunks: AsyncIterator[BaseModel], generation: Generation) -> AsyncIterator[str]:
    """SSE framing; an error after the stream started becomes an error chunk; always ends with [DONE].

    If the client goes away, Starlette cancels this generator: the requests are aborted (in
    `Generation.updates`) and the disconnect is counted.
    """
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except asyncio.CancelledError:
        generation.on_disconnect()
        raise
    except Exception as error:
        yield sse(to_api_error(error).error_response())
    finally:
        generation.abort()
    yield sse("[DONE]")


async def event_stream(events: AsyncIterator[dict], generation: Generation) -> AsyncIterator[str]:
    """Server-sent events as the Responses and Anthropic APIs frame them: each with an `event:` line naming its
    `type`, no [DONE] at the end. A client that goes away aborts the request and is counted, as in `sse_stream`."""
    try:
        async for payload in events:
            yield f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"
    except asyncio.CancelledError:
        generation.on_disconnect()
        raise
    finally:
        generation.abort()
