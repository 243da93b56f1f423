"""AsyncLLMEngine: runs `LLMEngine` on its own thread and feeds per-request async streams.

The HTTP event loop never runs a model step. Requests and aborts go to the engine thread
through a command queue; after each step the thread hands the step's deltas to their streams in
one call onto the event loop. A stream keeps the deltas its reader has not taken yet and hands
them over merged, so a slow reader never holds up the batch and costs only the text it has not read.

A failed model step fails the requests in flight and makes the engine unhealthy until a step
succeeds (or, with no traffic to prove it, for `unhealthy_after_failure_s`); after
`max_consecutive_step_failures` failed steps in a row the loop stops for good (`failed`), and
every request in flight or queued gets an error, so no client waits on a dead engine. With tensor
parallelism one failed step is enough (the ranks may no longer be in step), and so is a rank that exits,
even with nothing running: `fatal_error` says which, and the server exits on it.

The console's `EngineState` is taken on the engine thread too, between steps, only when someone asks
for it (a `_TakeState` command) and at most once per STATE_MAX_AGE_S; a step costs nothing extra
while nobody looks, beyond feeding the live figures' window the stats it reports anyway.
"""

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvserve.engine.engine_state import EngineState, StatsWindow, take_engine_state
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestDelta
from kvserve.engine.sampling_params import GrammarSpec, SamplingParams
from kvserve.engine.stats import StatsTracker, StepStats

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the client should retry later."""


class EngineUnavailableError(RuntimeError):
    """The engine is draining or stopped and takes no new requests."""


class EngineStepError(RuntimeError):
    """A model step failed while this request was in flight."""


EXPERT_TOKENS_INTERVAL_S = 1.0  # how often the expert-load counts are read off the device
STATE_MAX_AGE_S = 1.0  # a console poll gets the last snapshot if it is this recent, else asks for a new one
STATE_WAIT_S = 2.0  # how long a poll waits for the engine thread (busy in a long step) before taking the last one

# What clients are told: the exception itself (which may name files and lines) goes to the log only.
STEP_FAILED_MESSAGE = "the model step failed while this request was in flight; the server log has the details"


class RequestStream:
    """The deltas of one request its reader has not taken yet; used on the event loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._deltas: list[RequestDelta] = []
        self._error: Exception | None = None
        self._changed = asyncio.Event()
        self.finished = False

    def add(self, delta: RequestDelta) -> None:
        self._deltas.append(delta)
        self._changed.set()

    def set_error(self, error: Exception) -> None:
        self._error = error
        self._changed.set()

    def fail(self, error: Exception) -> None:
        """Called from the engine thread."""
        self.loop.call_soon_threadsafe(self.set_error, error)

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        """The deltas, merged as they piled up; an error is raised after the deltas that came before it, so a
        reader slower than the engine still gets every token made before a failed step."""
        while not self.finished:
            if not self._deltas and self._error is None:
                await self._changed.wait()
            self._changed.clear()
            if self._deltas:
                delta, self._deltas = RequestDelta.merge(self._deltas), []
                self.finished = delta.finished
                yield delta
            elif self._error is not None:
                self.finished = True
                raise self._error


def _deliver(deliveries: list[tuple[RequestStream, RequestDelta]]) -> None:
    for stream, delta in deliveries:
        stream.add(delta)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    stream: RequestStream
    arrival_s: float  # when the server accepted it, so queue time includes the wait for the engine thread


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _TakeState:
    asked_at_s: float  # a snapshot taken since then answers it too (several pollers, one snapshot)
    future: asyncio.Future


def _resolve(future: asyncio.Future, state: EngineState) -> None:
    if not future.done():  # the poller may have stopped waiting
        future.set_result(state)


class AsyncLLMEngine:
    """Thread-backed front of `LLMEngine` for asyncio servers."""

    engine: LLMEngine  # built on the engine thread; read-only elsewhere (tokenizer, limits, usage)

    def __init__(
        self,
        make_engine: Callable[[], LLMEngine],
        max_queued_requests: int,
        stall_timeout_s: float = 60.0,
        on_stats: Callable[[StepStats], None] | None = None,
        max_consecutive_step_failures: int = 3,
        unhealthy_after_failure_s: float = 30.0,
    ) -> None:
        """Builds the engine with `make_engine` on the engine thread and returns once it is ready.

        All torch work (loading, KV allocation, steps) stays on that one thread: measured on the CPU,
        steps ran ~1.6x slower when the model was built on another thread than the one stepping it.
        `on_stats` gets the stats of every loop iteration, on the engine thread, before its outputs
        are published (so a client that saw a token finds it counted); it must be quick.
        """
        self.max_queued_requests = max_queued_requests
        self.stall_timeout_s = stall_timeout_s
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self.unhealthy_after_failure_s = unhealthy_after_failure_s
        self.failed = False  # set when the loop stopped after too many failed steps in a row
        self.failure: str | None = None  # why, once `failed`
        self._on_stats = on_stats
        self._stats = StatsTracker()
        self._stats_window = StatsWindow()  # engine thread only
        self._state: EngineState  # the latest snapshot; replaced (never changed) by the engine thread
        self._commands: queue.SimpleQueue[_Add | _Abort | _TakeState | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched by the engine thread only
        self._lock = threading.Lock()
        self._num_in_flight = 0  # submitted and not yet finished, aborted or failed
        self._num_running = 0  # published by the engine thread after each step
        self._last_progress_s = time.monotonic()
        self._expert_tokens_read_s = 0.0
        self._num_failed_steps_in_a_row = 0
        self._last_failure_s = 0.0
        self._refusal: str | None = None  # why new requests are refused; None while accepting
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(make_engine,), name="kvserve-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def num_waiting(self) -> int:
        return max(0, self._num_in_flight - self._num_running)

    def is_healthy(self) -> bool:
        """The engine thread is alive, its last step did not fail (recently), and, if it has work, it finished
        a step recently."""
        if not self._thread.is_alive() or self.engine.rank_failure() is not None:
            return False
        now_s = time.monotonic()
        if self._num_failed_steps_in_a_row and now_s - self._last_failure_s < self.unhealthy_after_failure_s:
            return False
        return self._num_in_flight == 0 or now_s - self._last_progress_s < self.stall_timeout_s

    def fatal_error(self) -> str | None:
        """Why the engine can serve no more (it stopped, or a tensor-parallel rank exited); None while it can."""
        return self.failure or self.engine.rank_failure()

    def stop_accepting(self) -> None:
        with self._lock:
            self._refusal = "the server is shutting down"

    def shutdown(self) -> None:
        """Fail whatever is still in flight and stop the engine thread."""
        with self._lock:  # with `submit` under the same lock, no request is queued behind the stop command
            self._refusal = "the server is shutting down"
            self._commands.put(None)
        self._thread.join(timeout=10)

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
        cache_salt: str | None = None,
    ) -> RequestStream:  # fmt: skip
        """Check `params` against the prompt (tokenized and checked by `engine.tokenize_prompt`) and queue it.

        Raises `InvalidRequestError`, `EngineOverloadedError` or `EngineUnavailableError` before
        anything is queued.
        """
        self.engine.check_params(len(prompt_token_ids), params)
        stream = RequestStream(loop)
        with self._lock:
            if self._refusal is not None:
                raise EngineUnavailableError(self._refusal)
            if self.num_waiting >= self.max_queued_requests:
                raise EngineOverloadedError(f"{self.num_waiting} requests are already waiting")
            self._num_in_flight += 1
            self._commands.put(_Add(request_id, prompt_token_ids, params, cache_salt, stream, time.monotonic()))
        return stream

    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile (or find cached) a request's grammar on a worker thread, so that neither the event loop
        nor the engine's steps wait for it; raises `InvalidRequestError` if it does not compile."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine.grammars.compile, spec)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def engine_state(self) -> EngineState:
        """The latest snapshot of the KV cache and the queues; a new one, taken between steps, if the last is older
        than STATE_MAX_AGE_S and the engine thread gets to it within STATE_WAIT_S (its `taken_at` tells)."""
        state = self._state
        if time.monotonic() - state.taken_at_monotonic_s <= STATE_MAX_AGE_S or not self._thread.is_alive():
            return state
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_TakeState(time.monotonic(), future))
        try:
            return await asyncio.wait_for(future, STATE_WAIT_S)
        except TimeoutError:
            return self._state

    def _run(self, make_engine: Callable[[], LLMEngine]) -> None:
        try:
            self.engine = make_engine()
            self._report_stats()  # the KV cache's size and empty queues, before any request
            self._state = self._take_state()
        except BaseException as error:  # re-raised by the constructor on the caller's thread
            self._startup_error = error
            return
        finally:
            self._ready.set()
        try:
            self._loop()
        finally:
            self.engine.close()

    def _loop(self) -> None:
        while self._apply_commands(block=not self.engine.has_unfinished()):
            start_s = time.monotonic()
            try:
                deltas = self.engine.step()
            except Exception as error:  # a failed step must not kill the loop or strand clients
                logger.exception("engine step failed; failing the requests in flight")
                if self._step_failed(error):
                    return
                continue
            if not self.engine.scheduler.last_output.is_empty:  # only a step that ran the model shows it works
                self._num_failed_steps_in_a_row = 0
            self._last_progress_s = time.monotonic()
            self._num_running = len(self.engine.scheduler.running)
            self._stats.stepped(self.engine.scheduler.last_output, deltas, start_s, self._last_progress_s)
            self._report_stats()
            self._publish(deltas)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts (waiting for one if `block`); returns False on shutdown."""
        try:
            command = self._commands.get(block=block)
            while True:
                if command is None:
                    self._stop(EngineUnavailableError("the server shut down before this request finished"))
                    return False
                self._apply(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            self._last_progress_s = time.monotonic()
            return True

    def _publish(self, deltas: list[RequestDelta]) -> None:
        """Hand a step's deltas to their streams in one call onto the event loop (one wake-up a step)."""
        deliveries = []
        for delta in deltas:
            stream = self._close(delta.request_id) if delta.finished else self._streams.get(delta.request_id)
            if stream is not None:
                deliveries.append((stream, delta))
        if deliveries:
            deliveries[0][0].loop.call_soon_threadsafe(_deliver, deliveries)

    def _apply(self, command: _Add | _Abort | _TakeState) -> None:
        if isinstance(command, _TakeState):
            if self._state.taken_at_monotonic_s < command.asked_at_s:
                self._state = self._take_state()
            with contextlib.suppress(RuntimeError):  # the poller's event loop closed (the server stopped)
                command.future.get_loop().call_soon_threadsafe(_resolve, command.future, self._state)
            return
        if isinstance(command, _Abort):
            delta = self.engine.abort(command.request_id)
            self._stats.finished(command.request_id, "abort")
            stream = self._close(command.request_id)
            if delta is not None and stream is not None:
                stream.loop.call_soon_threadsafe(stream.add, delta)
            return
        self._stats.arrived(command.request_id, len(command.prompt_token_ids), command.arrival_s)
        try:
            self.engine.enqueue(command.request_id, command.prompt_token_ids, command.params, command.cache_salt)
        except Exception as error:  # checked at submit; anything left is reported, not raised
            self._stats.finished(command.request_id, "error")
            self._streams[command.request_id] = command.stream
            self._close(command.request_id).fail(error)
            return
        self._streams[command.request_id] = command.stream

    def _close(self, request_id: str) -> RequestStream | None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            with self._lock:
                self._num_in_flight -= 1
        return stream

    def _step_failed(self, error: Exception) -> bool:
        """Fail the requests in flight; True if that was one failed step too many and the loop must end."""
        self._num_failed_steps_in_a_row += 1
        self._last_failure_s = time.monotonic()
        self._fail_all(EngineStepError(STEP_FAILED_MESSAGE))
        self._report_stats()
        if self.engine.ranks is not None:  # a collective failed or was cut short: the ranks are out of step
            failure = self.engine.rank_failure() or f"a tensor-parallel step failed ({error})"
            self.engine.ranks.kill()  # nothing to wait for: a hung rank would not hear a stop
        elif self._num_failed_steps_in_a_row < self.max_consecutive_step_failures:
            return False
        else:
            failure = f"{self._num_failed_steps_in_a_row} model steps failed in a row"
        logger.error("%s; the engine stops", failure)
        self._stop(EngineUnavailableError(f"the engine stopped: {failure}"))
        self.failure, self.failed = failure, True
        return True

    def _stop(self, error: Exception) -> None:
        """Refuse new requests, then fail every request in flight and every one still queued."""
        with self._lock:
            self._refusal = str(error)
        self._fail_all(error)
        while True:  # after the refusal no request is queued any more, so this ends
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                with self._lock:
                    self._num_in_flight -= 1
                command.stream.fail(error)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            self._stats.finished(request_id, "error")
            self._close(request_id).fail(error)
        self._num_running = 0

    def _report_stats(self) -> None:
        expert_tokens = None
        now_s = time.monotonic()
        # A read waits for the device: about once a second, and when the engine goes idle (all counted).
        due = now_s - self._expert_tokens_read_s >= EXPERT_TOKENS_INTERVAL_S or not self.engine.has_unfinished()
        if due:
            expert_tokens, self._expert_tokens_read_s = self.engine.take_expert_tokens(), now_s
        stats = self._stats.collect(self.engine.scheduler, expert_tokens)  # collected even unread: nothing piles up
        self._stats_window.record(stats, now_s)
        if self._on_stats is not None:
            self._on_stats(stats)

    def _take_state(self) -> EngineState:
        """Engine thread only, between steps: the one place the console reads the scheduler and the allocator."""
        return take_engine_state(self.engine.scheduler, self._stats_window, time.monotonic(), time.time())
