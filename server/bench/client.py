"""The HTTP side of the bench: the model list check before a run, and one streamed request with its timings.

Token counts come from the usage the server reports in the stream (server/bench/endpoints.py says where each API puts
it), so they are exact whatever the tokenizer; the times come from when each event carrying generated tokens arrives.
"""

import asyncio
import itertools
import json
import os
import socket
import time
from dataclasses import dataclass, field

import httpx

from kvserve.server.bench.config import BenchConfig
from kvserve.server.bench.endpoints import read_event, request_body
from kvserve.server.bench.errors import BenchError
from kvserve.server.bench.workload import BenchRequest

MODELS_TIMEOUT_S = 10.0
MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it; times are seconds since the run began."""

    index: int
    output_len: int  # what was asked for (max_tokens)
    start_s: float
    end_s: float  # the end of the stream, or the error
    chunk_times_s: tuple[float, ...]  # when each chunk of generated tokens arrived
    prompt_tokens: int
    output_tokens: int
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else None

    @property
    def itl_s(self) -> list[float]:
        """The gaps between chunks (as vLLM's ITL): a chunk holding several tokens is one gap."""
        return [later - earlier for earlier, later in itertools.pairwise(self.chunk_times_s)]

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None for a single token."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


async def list_models(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> list[str]:
    """The served model ids; raises BenchError saying why the target cannot be benchmarked."""
    url = base_url + "/v1/models"
    try:
        response = await client.get(url, headers=headers, timeout=MODELS_TIMEOUT_S)
    except httpx.HTTPError as error:
        raise BenchError(describe_http_error(url, error)) from error
    if response.status_code != 200:
        raise BenchError(f"{url} answered HTTP {response.status_code}: {server_message(response)}")
    try:
        ids = [model["id"] for model in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as error:
        raise BenchError(f"{url} did not answer with a model list: is it an OpenAI-compatible server?") from error
    if not ids:
        raise BenchError(f"{url} lists no models")
    return ids


async def send_request(
    client: httpx.AsyncClient, config: BenchConfig, index: int, request: BenchRequest, run_start_s: float
) -> RequestRecord:
    stream = _Stream()
    start_s = time.perf_counter() - run_start_s
    error = None
    try:
        async with asyncio.timeout(config.timeout_s):
            error = await _stream_resending_if_dropped(client, config, request, stream, run_start_s)
    except TimeoutError:
        error = f"no complete response within {config.timeout_s:g} s (--timeout-s)"
    except httpx.HTTPError as http_error:
        error = describe_http_error(config.request_url, http_error)
    end_s = time.perf_counter() - run_start_s
    if error is None and not stream.chunk_times_s:
        error = "the stream ended without generated tokens"
    if error is None and stream.output_tokens is None:
        error = "the stream reports no usage (with completions and chat: the server ignores stream_options)"
    return RequestRecord(
        index=index, output_len=request.output_len, start_s=start_s, end_s=end_s,
        chunk_times_s=tuple(stream.chunk_times_s), prompt_tokens=stream.prompt_tokens or 0,
        output_tokens=stream.output_tokens or 0, error=error,
    )  # fmt: skip


@dataclass
class _Stream:
    """What a stream has delivered so far."""

    chunk_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    started: bool = False  # a response's status line came


async def _stream_resending_if_dropped(
    client: httpx.AsyncClient, config: BenchConfig, request: BenchRequest, stream: _Stream, run_start_s: float
) -> str | None:
    """`_stream`, sent once more where the server closed the connection before any byte of a response: a kept-alive
    connection the server has dropped meanwhile fails that way (llama-server drops some), and a request no server
    began to answer is safe to send again. A stream cut after it began is an error."""
    try:
        return await _stream(client, config, request, stream, run_start_s)
    except httpx.RemoteProtocolError:
        if stream.started:
            raise
        return await _stream(client, config, request, stream, run_start_s)


async def _stream(
    client: httpx.AsyncClient, config: BenchConfig, request: BenchRequest, stream: _Stream, run_start_s: float
) -> str | None:
    """Read one response into `stream`; the error message, or None when it ended well."""
    body = request_body(config.endpoint, config.model, request.prompt, request.output_len, config.temperature,
                        config.ignore_eos)  # fmt: skip
    async with client.stream("POST", config.request_url, json=body, headers=config.headers) as response:
        stream.started = True
        if response.status_code != 200:
            await response.aread()
            return f"HTTP {response.status_code}: {server_message(response)}"
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments (keep-alive pings), event names
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                continue  # read on to the end of the body, so the connection can serve the next request
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                chunk = None
            if not isinstance(chunk, dict):
                return f"a stream chunk is not a JSON object: {payload[:MAX_ERROR_CHARS]!r}"
            event = read_event(config.endpoint, chunk)
            if event.error is not None:
                return f"error in the stream: {_error_text(event.error)}"
            if event.carries_tokens:
                stream.chunk_times_s.append(time.perf_counter() - run_start_s)
            stream.prompt_tokens = event.prompt_tokens if event.prompt_tokens is not None else stream.prompt_tokens
            stream.output_tokens = event.output_tokens if event.output_tokens is not None else stream.output_tokens
    return None  # without [DONE] too: what counts is that tokens and the usage came


def server_message(response: httpx.Response) -> str:
    """The error message in a response body: OpenAI's `error.message`, FastAPI's `detail`, or the text."""
    try:
        return _error_text(response.json())
    except ValueError:
        return response.text.strip()[:MAX_ERROR_CHARS] or response.reason_phrase


def _error_text(body: object) -> str:
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            message = error.get("message") or error.get("detail")
            if message:
                return str(message)[:MAX_ERROR_CHARS]
        elif isinstance(error, str):
            return error[:MAX_ERROR_CHARS]
    return json.dumps(body)[:MAX_ERROR_CHARS]


def describe_http_error(url: str, error: httpx.HTTPError) -> str:
    """One line for a transport failure: "cannot connect to URL: connection refused"."""
    if isinstance(error, httpx.ConnectError):
        return f"cannot connect to {url}: {_os_reason(error)}"
    if isinstance(error, httpx.TimeoutException):
        return f"timed out talking to {url} ({type(error).__name__})"
    return f"{url}: {type(error).__name__}: {error}"


def _os_reason(error: BaseException) -> str:
    """The system's words for the first OS error behind `error` ("connection refused"): httpx's own message for a
    refused loopback port is "All connection attempts failed", which does not say why."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, socket.gaierror):  # a name lookup: errno is resolver's, strerror says it
            return str(cause.strerror).lower()
        if isinstance(cause, OSError) and cause.errno is not None:
            return os.strerror(cause.errno).lower()
        cause = cause.__cause__ or cause.__context__
    return str(error).rsplit("] ", 1)[-1].strip().lower() or type(error).__name__
