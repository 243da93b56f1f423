"""What completions and chat share: submitting n x prompts, merging their streams, streaming deltas."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from fastapi import Request

from kvserve.engine import RequestDelta, SamplingParams, TokenLogprob
from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
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

    def drop_output(self) -> None:
        """Forget the generated tokens (a request that only scores its prompt generates one, not returned)."""
        self.token_ids, self.text_parts, self.logprobs = [], [], None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Generation:
    """All choices of one API request, submitted to the engine together and aborted together."""

    def __init__(
        self, engine: AsyncLLMEngine, request_id: str, model_name: str, on_disconnect: Callable[[], None]
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.model_name = model_name
        self.created = now_s()
        self.on_disconnect = on_disconnect
        self.choices: list[Choice] = []
        self._streams: list[RequestStream] = []
        self._prompts: list[list[int]] = []

    def submit(self, prompts: list[list[int]], params: SamplingParams, n: int, cache_salt: str | None = None) -> None:
        """Queue every choice, or none: a refusal aborts what was already queued."""
        loop = asyncio.get_running_loop()
        self._prompts = prompts
        try:
            for prompt_index, prompt_token_ids in enumerate(prompts):
                for sample_index in range(n):
                    choice_params = params
                    if params.seed is not None and sample_index:
                        choice_params = replace(params, seed=params.seed + sample_index)
                    index = prompt_index * n + sample_index
                    engine_id = self._engine_id(index)
                    stream = self.engine.submit(engine_id, prompt_token_ids, choice_params, loop, cache_salt)
                    self.choices.append(Choice(index))
                    self._streams.append(stream)
        except Exception:
            self.abort()
            raise

    def abort(self) -> None:
        for choice in self.choices:
            if choice.finish_reason is None:
                self.engine.abort(self._engine_id(choice.index))

    async def updates(self) -> AsyncIterator[tuple[Choice, RequestDelta]]:
        """Each choice with its delta every time it has new output, until all are finished; aborts on exit.

        Every delta carries tokens or a finish: a token whose text is empty (a special token skipped in the text)
        comes in its own step's delta, as in vLLM, so streams send a chunk for it, its logprobs ride along, and
        clients time the first token, not the first visible text."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice, stream: RequestStream) -> None:
            try:
                async for delta in stream:
                    queue.put_nowait((choice, delta))
            except Exception as error:
                queue.put_nowait(error)

        tasks = [asyncio.create_task(pump(c, s)) for c, s in zip(self.choices, self._streams, strict=True)]
        try:
            num_finished = 0
            while num_finished < len(self.choices):
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                choice, delta = item
                choice.add(delta)
                num_finished += delta.finished
                yield choice, delta
        finally:
            for task in tasks:
                task.cancel()
            self.abort()

    def prompt_token_ids(self, choice: Choice) -> list[int]:
        return self._prompts[choice.index // (len(self.choices) // len(self._prompts))]

    def usage(self) -> Usage:
        """Each prompt's tokens once (whatever n is), and every choice's generated tokens."""
        completion_tokens = sum(len(choice.token_ids) for choice in self.choices)
        return Usage.of(sum(len(prompt) for prompt in self._prompts), completion_tokens)

    def chunk(self, object_name: str, choices: list[dict], usage: Usage | None = None) -> dict:
        """A streamed chunk object of this request."""
        payload = {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model_name,
                   "choices": choices}  # fmt: skip
        if usage is not None:
            payload["usage"] = usage.model_dump()
        return payload

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

    def _engine_id(self, index: int) -> str:
        return f"{self.request_id}-{index}"


async def _wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def sse_stream(chunks: AsyncIterator[dict], generation: Generation) -> AsyncIterator[str]:
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
        yield sse(to_api_error(error).body())
    finally:
        generation.abort()
    yield sse("[DONE]")
