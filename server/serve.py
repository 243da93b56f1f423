"""`kvserve serve`: build the engine and the app, run uvicorn, drain on SIGTERM, stop if the engine fails."""

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import uvicorn

from kvserve.engine import LLMEngine
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.default_model import DEFAULT_MODEL_NAME
from kvserve.engine.input_processor import RequestLimits
from kvserve.engine.parallel.launch import launched_rank
from kvserve.engine.parallel.rank_process import run_launched_rank
from kvserve.engine.startup import StartupProgress
from kvserve.server.app import create_app
from kvserve.server.context import ServerContext
from kvserve.server.metrics import ServerMetrics
from kvserve.server.settings import ServerSettings

logger = logging.getLogger(__name__)
DRAIN_POLL_S = 0.1
# h11's cap on a request head still incomplete; the app's own header limits (request_limits.py) are lower.
MAX_INCOMPLETE_EVENT_BYTES = 64 * 1024


def build_context(settings: ServerSettings, wait_ready: bool = True) -> ServerContext:
    """The server's context; its engine is built on the engine thread, and, unless `wait_ready`, still being built
    when this returns (`kvserve serve` binds its port meanwhile, and answers 503 "starting: <phase>")."""
    default_name = Path(settings.model).name if settings.model else DEFAULT_MODEL_NAME
    model_name = settings.served_model_name or default_name
    metrics = ServerMetrics(model_name)
    metrics.tensor_parallel_size.set(settings.tensor_parallel_size)
    engine = AsyncLLMEngine(
        lambda progress: _make_engine(settings, progress),
        max_queued_requests=settings.max_queued_requests,
        on_stats=metrics.record_step,
        max_consecutive_step_failures=settings.max_consecutive_step_failures,
        stall_timeout_s=settings.engine_stall_timeout_s,
        wait_ready=wait_ready,
    )
    return ServerContext(settings=settings, engine=engine, model_name=model_name, metrics=metrics)


def _make_engine(settings: ServerSettings, progress: StartupProgress) -> LLMEngine:
    limits = RequestLimits(
        max_n=settings.max_n, max_prompts=settings.max_prompts, max_stop_strings=settings.max_stop_strings,
        max_stop_string_chars=settings.max_stop_string_chars,
    )  # fmt: skip
    engine = LLMEngine(settings.engine_config(), limits, _read_chat_template(settings.chat_template), progress)
    if os.environ.get("KVSERVE_FAULT_INJECTION"):  # tests only: the serving path never imports kvserve.testing
        from kvserve.testing import fault_injection

        fault_injection.inject_from_env(engine)
    return engine


def uvicorn_config(ctx: ServerContext, **options) -> uvicorn.Config:
    """The app under uvicorn as `kvserve serve` runs it (tests pass where to listen and how to log)."""
    return uvicorn.Config(
        create_app(ctx), timeout_graceful_shutdown=2, h11_max_incomplete_event_size=MAX_INCOMPLETE_EVENT_BYTES,
        **options,
    )  # fmt: skip


def _read_chat_template(template: str | None) -> str | None:
    """A path to a template file, or the template itself."""
    if template is None:
        return None
    path = Path(template)
    return path.read_text() if len(template) < 4096 and path.is_file() else template


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: answer 503 to new requests, let in-flight ones finish for up to
    `drain_timeout_s`, fail the rest with 503, then stop. A second signal, or a timeout of 0, fails the requests
    in flight with 503 and stops at once.
    If the engine stops (repeated failed steps, or a tensor-parallel rank gone), the server stops too, with
    `exit_status` 1."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext) -> None:
        super().__init__(config)
        self.ctx = ctx
        self._draining = False
        self.exit_status = 0
        self._started_s = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        # uvicorn calls this every 0.1 s; a failed engine takes no more requests, so a supervisor should restart us.
        failure = self.ctx.engine.fatal_error()
        if failure is not None and not self.exit_status:
            if self.ctx.engine.startup_error is not None:
                logger.error("%s; exiting", failure)
            else:
                logger.error("the engine cannot serve any more (%s); exiting with status 1", failure)
            self._exit(1)
        phase, limit_s = self.ctx.engine.starting(), self.ctx.settings.startup_timeout_s
        if phase is not None and limit_s is not None and time.monotonic() - self._started_s > limit_s:
            if not self.exit_status:
                logger.error("start-up did not finish within %.0f s: stuck %s; exiting with status 1", limit_s, phase)
            self._exit(1)
        return await super().on_tick(counter)

    def _exit(self, status: int) -> None:
        self.exit_status = self.exit_status or status
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        timeout_s = self.ctx.settings.drain_timeout_s
        if self._draining or timeout_s == 0:
            # Not uvicorn's handle_exit: it re-raises the signal once shut down, which kills the process before
            # `serve` shuts the engine down, with another exit status than a drained stop (0).
            self.force_exit = self._draining
            self.should_exit = True
            # The requests in flight get their 503 now, so uvicorn need not wait out its graceful shutdown for them.
            threading.Thread(target=self.ctx.engine.shutdown, daemon=True).start()
            return
        self._draining = True
        self.config.app.state.draining = True
        self.ctx.engine.stop_accepting()
        logger.info("draining: %d requests in flight, up to %.1f s", self.ctx.engine.num_in_flight, timeout_s)
        threading.Thread(target=self._exit_when_drained, args=(timeout_s,), daemon=True).start()

    def _exit_when_drained(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ctx.engine.num_in_flight and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
        logger.info("drained (%d requests left in flight); stopping", self.ctx.engine.num_in_flight)
        # The requests still running get their 503 (or an SSE error chunk) now, so uvicorn's graceful shutdown
        # finds every handler done instead of cutting connections after its own timeout.
        self.ctx.engine.shutdown()
        self.should_exit = True


def serve(settings: ServerSettings) -> int:
    """Serve until stopped; returns the process exit status (0, or 1 if the engine failed).

    A tensor-parallel rank other than 0 launched from outside (RANK set, as torchrun does) serves no HTTP: it runs
    the worker loop until rank 0 stops it."""
    rank = launched_rank()
    if settings.tensor_parallel_size > 1 and rank not in (None, 0):
        logger.info("tensor-parallel rank %d: running the worker loop for rank 0", rank)
        run_launched_rank(settings.engine_config())
        return 0
    ctx = build_context(settings, wait_ready=False)
    server = DrainingServer(uvicorn_config(ctx, host=settings.host, port=settings.port, log_level="info"), ctx)
    logger.info("serving %r at http://%s:%d/v1 (docs at /docs); /health answers 503 until start-up is done",
                ctx.model_name, settings.host, settings.port)  # fmt: skip
    status = 1  # unless the server returns, or uvicorn exits with a status of its own
    try:
        server.run()
        status = server.exit_status
    except SystemExit as error:  # uvicorn's, when it cannot bind the port (it has logged why)
        status = error.code if isinstance(error.code, int) else 1
    finally:
        ctx.engine.shutdown()
        if not ctx.engine.ready:
            _leave_before_ready(ctx.engine.startup_error, status)
    return status


def _leave_before_ready(startup_error: BaseException | None, status: int) -> NoReturn:
    """Exit a server whose engine was never built: a checkpoint kvserve cannot load is one `error:` line and status
    2 (as bad settings are); the processes a build left running are stopped. The engine thread may be inside torch
    (loading weights, the fallback after a stopped build), and the interpreter's exit would tear torch down under
    it (std::terminate, a core dump): nothing of an unfinished start-up needs saving, so leave at once."""
    from kvserve.server.cli import model_errors

    if isinstance(startup_error, model_errors()):
        print(f"error: {startup_error}", file=sys.stderr, flush=True)
        status = 2
    _stop_descendants()
    logging.shutdown()
    os._exit(status)


def _stop_descendants() -> None:
    """SIGTERM to the processes below this one: leaving before the engine is built (a signal, a start-up timeout),
    the compiler and ninja of a first build of the C++ kernels would run on without us. (Tensor-parallel ranks die
    with this process on their own.)"""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone while we looked
        children.setdefault(parent, []).append(int(stat.parent.name))
    below, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            below.append(child)
            todo.append(child)
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    if below:
        logger.info("stopped %d processes left by the unfinished start-up", len(below))
