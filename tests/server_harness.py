"""A real uvicorn server on a free loopback port, run in a thread of the test process.

Running in-process lets tests look at the engine behind the HTTP API (KV blocks, metrics)
while clients talk to it over real sockets.
"""

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from kvserve.server.context import ServerContext
from kvserve.server.metrics import PREFIX
from kvserve.server.serve import build_context, uvicorn_config
from kvserve.server.settings import ServerSettings

STARTUP_TIMEOUT_S = 60
TINY_MODEL = "tiny-llama"
TINY_KV_CACHE_BYTES = 4 << 20  # 8192 tokens of the tiny Llama
STEP_DELAY_S = 0.005  # added to every model step where a test needs requests to stay in flight
SETTLE_TIMEOUT_S = 5.0


@dataclass
class RunningServer:
    ctx: ServerContext
    base_url: str  # http://127.0.0.1:PORT

    @property
    def engine(self):
        """The synchronous LLMEngine behind the server."""
        return self.ctx.engine.engine

    def metric(self, name: str, **labels: str) -> float | None:
        """A sample's value in the server's registry (`name` without the kvserve: prefix); None if absent."""
        return self.ctx.metrics.registry.get_sample_value(PREFIX + name, {"model_name": self.ctx.model_name, **labels})

    def wait_until_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until no request is in flight (aborts are applied by the engine thread)."""
        deadline = time.monotonic() + timeout_s
        while self.ctx.engine.num_in_flight or self.engine.has_unfinished():
            if time.monotonic() > deadline:
                raise TimeoutError("requests still in flight")
            time.sleep(0.02)


@contextmanager
def running_server(**settings) -> Iterator[RunningServer]:
    ctx = build_context(ServerSettings(**settings))
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets whose proto says TCP; without it every
    # keep-alive response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(ctx, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(ctx=ctx, base_url=f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        ctx.engine.shutdown()
        sock.close()


def tiny_server(checkpoints: dict[str, Path], **settings) -> AbstractContextManager[RunningServer]:
    """A server of its own on the tiny Llama checkpoint, served as TINY_MODEL; `settings` override the defaults."""
    defaults = {"model": str(checkpoints["llama"]), "served_model_name": TINY_MODEL,
                "kv_cache_memory_bytes": TINY_KV_CACHE_BYTES}  # fmt: skip
    return running_server(**{**defaults, **settings})


def slow_down_steps(running: RunningServer, monkeypatch, delay_s: float = STEP_DELAY_S) -> None:
    """Every model step takes at least `delay_s`, so long requests last long on any machine."""
    execute = running.engine.core.runner.execute

    def slow_execute(scheduler_output, *args):
        time.sleep(delay_s)
        return execute(scheduler_output, *args)

    monkeypatch.setattr(running.engine.core.runner, "execute", slow_execute)


def wait_for(condition: Callable[[], bool], timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the server did not settle in time"
        time.sleep(0.01)


def assert_nothing_allocated(running: RunningServer) -> None:
    running.wait_until_idle()
    assert not running.engine.has_unfinished()
    assert running.engine.kv_usage().num_used_blocks == 0


def assert_openai_error(response, status: int, param: str | None = None) -> dict:
    """`response` has `status` and exactly OpenAI's error body, naming `param`; returns the error object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"]
    return assert_error_object(body["error"], param)


def assert_error_object(error: dict, param: str | None = None) -> dict:
    """`error` is an OpenAI error object `{"message", "type", "param", "code"}` naming `param`."""
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param, error
    assert error["code"] is None or isinstance(error["code"], str | int)
    return error
