"""AsyncLLMEngine: the server's one door to the engine. The core steps on a thread of its own; requests come in and
their text goes out on the server's event loop.

A request goes through the input processor on the event loop (a grammar is built on a worker thread first, so
neither the loop nor the steps wait for it), then to the engine thread through a command queue. After each step
the engine thread hands the step's `StepResult` to the event loop in one call; there the output processor turns
its tokens into each request's delta (detokenizing, stop strings, logprob texts), off the step's path, and feeds
the requests' streams. A stream keeps the deltas its reader has not taken yet and hands them over merged, so a
slow reader never holds up the batch. A stop string found there finishes the request in the core a step later.

A failed model step fails the requests in flight and makes the engine unhealthy until a step succeeds (or, with
no traffic to prove it, for `unhealthy_after_failure_s`); after `max_consecutive_step_failures` failed steps in a
row the loop stops for good (`failed`), and every request in flight or queued gets an error, so no client waits
on a dead engine. With tensor parallelism one failed step is enough (the ranks may no longer be in step), and so
is a rank that exits, even with nothing running: `fatal_error` says which, and the server exits on it.

The console's `EngineState` is taken on the engine thread too, between steps, only when someone asks for it (a
`_TakeState` command) and at most once per STATE_MAX_AGE_S; a step costs nothing extra while nobody looks, beyond
feeding the live figures' window the stats it reports anyway.
"""

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvserve.engine.engine_state import EngineState, StatsWindow
from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.lora.peft_adapter import LoraAdapter
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.outputs import RequestDelta
from kvserve.engine.parallel.watchdog import STUCK_AFTER_TIMEOUTS, StepWatchdog
from kvserve.engine.pooling import PoolingConfig
from kvserve.engine.request import ChatPrompt, CoreRequest, GenerationRequest, ProcessedRequest
from kvserve.engine.startup import StartupProgress
from kvserve.engine.stats import StatsTracker, StepStats
from kvserve.engine.step_result import StepResult
from kvserve.kvcache import AdapterTag
from kvserve.scheduler import FinishReason

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

    def __init__(self) -> None:
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


class GenerationStream:
    """Every choice of one `GenerationRequest` (n samples of each prompt), queued together and aborted together.
    Choice i is sample i % n of prompt i // n (`processed.prompt_of(i)`)."""

    def __init__(self, engine: "AsyncLLMEngine", processed: ProcessedRequest, request_ids: list[str],
                 streams: list[RequestStream]) -> None:  # fmt: skip
        self.processed = processed
        self._engine = engine
        self._request_ids = request_ids
        self._streams = streams
        self._finished = [False] * len(streams)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """(choice index, its delta) every time a choice has new output, until all are finished; aborts what is
        unfinished on exit (the reader left, or failed). Every delta carries tokens or a finish: a token whose text
        is empty (a skipped special token) comes in its own step's delta, as in vLLM, so streams send a chunk for
        it, its logprobs ride along, and clients time the first token, not the first visible text."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for delta in stream:
                    merged.put_nowait((index, delta))
            except Exception as error:
                merged.put_nowait(error)

        tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(self._streams)]
        try:
            while not all(self._finished):
                item = await merged.get()
                if isinstance(item, Exception):
                    raise item
                index, delta = item
                self._finished[index] = delta.finished
                yield index, delta
        finally:
            for task in tasks:
                task.cancel()
            self.abort()

    def abort(self) -> None:
        ids_and_done = zip(self._request_ids, self._finished, strict=True)
        unfinished = [request_id for request_id, done in ids_and_done if not done]
        if unfinished:
            self._engine.abort(unfinished)


@dataclass(frozen=True)
class _Add:
    request: CoreRequest
    arrival_s: float  # when the server accepted it, so queue time includes the wait for the engine thread


@dataclass(frozen=True)
class _Finish:
    """Take a request out of the core: an abort, or a stop string the output processor found."""

    request_id: str
    reason: FinishReason


@dataclass(frozen=True)
class _TakeState:
    asked_at_s: float  # a snapshot taken since then answers it too (several pollers, one snapshot)
    future: asyncio.Future


@dataclass(frozen=True)
class _LoadLora:
    adapter: LoraAdapter  # read from its files off both threads
    replace: bool  # unload an adapter of the same name first
    future: asyncio.Future


@dataclass(frozen=True)
class _UnloadLora:
    name: str


def _resolve(future: asyncio.Future, result: object) -> None:
    if future.done():  # the asker may have stopped waiting
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _answer(future: asyncio.Future, result: object) -> None:
    """Resolve an event-loop future from the engine thread."""
    with contextlib.suppress(RuntimeError):  # the asker's event loop closed (the server stopped)
        future.get_loop().call_soon_threadsafe(_resolve, future, result)


class AsyncLLMEngine:
    """The engine for asyncio servers: `generate` a request, read its `GenerationStream`."""

    engine: LLMEngine  # built on the engine thread; its core is touched there only (tests may look)
    inputs: InputProcessor
    outputs: OutputProcessor  # event loop only

    def __init__(
        self,
        make_engine: Callable[[StartupProgress], LLMEngine],
        max_queued_requests: int,
        stall_timeout_s: float = 60.0,
        on_stats: Callable[[StepStats], None] | None = None,
        max_consecutive_step_failures: int = 3,
        unhealthy_after_failure_s: float = 30.0,
        wait_ready: bool = True,
    ) -> None:
        """Builds the engine with `make_engine(progress)` on the engine thread and returns once it is ready (raising
        what the build raised), or at once if not `wait_ready`: a server then answers while it starts (`starting`,
        `startup_error`), and requests must wait for `ready`.

        All torch work (loading, KV allocation, steps) stays on that one thread: measured on the CPU,
        steps ran ~1.6x slower when the model was built on another thread than the one stepping it.
        `on_stats` gets the stats of every loop iteration, on the engine thread, before its outputs
        are published (so a client that saw a token finds it counted); it must be quick.
        """
        self.max_queued_requests = max_queued_requests
        self.stall_timeout_s = stall_timeout_s
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self.unhealthy_after_failure_s = unhealthy_after_failure_s
        self.failed = False  # set when the loop stopped (too many failed steps in a row, or a tensor-parallel one)
        self.failure: str | None = None  # why, once `failed`
        self._stuck = False  # a tensor-parallel step the watchdog found stuck: the engine thread may never return
        self._on_stats = on_stats
        self._stats = StatsTracker()  # engine thread only
        self._stats_window = StatsWindow()  # engine thread only
        self._state: EngineState  # the latest snapshot; replaced (never changed) by the engine thread
        self._commands: queue.SimpleQueue[_Add | _Finish | _TakeState | _LoadLora | _UnloadLora | None] = (
            queue.SimpleQueue()
        )
        self._loras: dict[str, AdapterTag] = {}  # the loaded LoRA adapters, as the event loop sees them
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's, set by the first request
        self._streams: dict[str, RequestStream] = {}  # event loop only
        self._lock = threading.Lock()
        self._num_in_flight = 0  # queued and not yet finished, aborted or failed (changed on the event loop)
        self._num_running = 0  # published by the engine thread after each step
        self._last_progress_s = time.monotonic()
        self._expert_tokens_read_s = 0.0
        self._num_failed_steps_in_a_row = 0
        self._last_failure_s = 0.0
        self._refusal: str | None = None  # why new requests are refused; None while accepting
        self.progress = StartupProgress()
        self._ready = threading.Event()  # set once the build ended, built or not
        self.startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(make_engine,), name="kvserve-engine", daemon=True)
        self._thread.start()
        if wait_ready:
            self._ready.wait()
            if self.startup_error is not None:
                raise self.startup_error

    @property
    def ready(self) -> bool:
        """Built and stepping (a failed build is never ready)."""
        return self._ready.is_set() and self.startup_error is None

    def starting(self) -> str | None:
        """The start-up phase under way while the engine is being built; None once the build ended."""
        return None if self._ready.is_set() else self.progress.current

    # The server's side (event loop)

    @property
    def max_model_len(self) -> int:
        return self.inputs.model.max_model_len

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def num_waiting(self) -> int:
        return max(0, self._num_in_flight - self._num_running)

    def tokenize(self, prompt: str | ChatPrompt, add_special_tokens: bool = True) -> list[int]:
        return self.inputs.tokenize(prompt, add_special_tokens)

    def token_text(self, token_id: int) -> str:
        """A token decoded alone, as logprobs show it."""
        return self.outputs.token_text(token_id)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids as text (`InvalidRequestError` for an id outside the vocabulary)."""
        return self.inputs.decode(token_ids, skip_special_tokens)

    async def generate(self, request: GenerationRequest, request_id: str) -> GenerationStream:
        """Check and queue every choice of `request`, or none; its choices' ids are `{request_id}-{index}`.

        Raises `InvalidRequestError`, `EngineOverloadedError` or `EngineUnavailableError` before anything is
        queued.
        """
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError("an AsyncLLMEngine serves one event loop")
        grammar = request.params.structured_output
        if grammar is not None:  # built on a worker thread (and cached), so the event loop never waits for it
            await loop.run_in_executor(None, self.inputs.compile_grammar, grammar)
        processed = self.inputs.process(request)
        core_requests = list(processed.core_requests(request_id))
        streams = [RequestStream() for _ in core_requests]
        arrival_s = time.monotonic()
        with self._lock:
            if self._refusal is not None:
                raise EngineUnavailableError(self._refusal)
            if self.num_waiting >= self.max_queued_requests:
                raise EngineOverloadedError(f"{self.num_waiting} requests are already waiting")
            for core_request, stream in zip(core_requests, streams, strict=True):
                self.outputs.add(core_request.request_id, core_request.params)
                self._streams[core_request.request_id] = stream
                self._commands.put(_Add(core_request, arrival_s))
            self._num_in_flight += len(core_requests)
        return GenerationStream(self, processed, [r.request_id for r in core_requests], streams)

    # LoRA adapters (event loop). Requests name an adapter by what `lora_tag` says now; loads and unloads reach the
    # engine thread through the command queue behind the requests queued before them, so a request never runs under
    # an adapter unloaded before it was queued.

    def lora_tag(self, name: str) -> AdapterTag | None:
        """The loaded adapter called `name`, if there is one."""
        return self._loras.get(name)

    def loaded_loras(self) -> list[AdapterTag]:
        return list(self._loras.values())

    @property
    def serves_loras(self) -> bool:
        return self.engine.core.loras is not None

    @property
    def pooling(self) -> PoolingConfig | None:
        """An embedding engine's pooling (None: the engine generates)."""
        pooler = self.engine.core.pooler
        return pooler.config if pooler is not None else None

    async def load_lora(self, name: str, path: str, replace: bool = False) -> AdapterTag:
        """Read an adapter's files (on a worker thread) and load it; `replace`: an adapter already loaded under the
        name is unloaded first (its running requests finish with it). Raises `LoraAdapterError` for a bad adapter,
        `ValueError` for a name already loaded."""
        loop = asyncio.get_running_loop()
        adapter = await loop.run_in_executor(None, self.engine.read_lora, name, path)
        if not replace and name in self._loras:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        future = loop.create_future()
        with self._lock:  # a stopped engine would never answer
            if self._refusal is not None:
                raise EngineUnavailableError(self._refusal)
            self._commands.put(_LoadLora(adapter, replace, future))
        self._loras[name] = tag = await future
        return tag

    def unload_lora(self, name: str) -> bool:
        """Unload an adapter (False if it is not loaded): new requests cannot name it from now on."""
        if self._loras.pop(name, None) is None:
            return False
        self._commands.put(_UnloadLora(name))
        return True

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests (their client is gone): their streams now, their blocks at the engine's next command."""
        for request_id in request_ids:
            self.outputs.abort(request_id)
            if self._streams.pop(request_id, None) is not None:
                self._num_in_flight -= 1
            self._commands.put(_Finish(request_id, FinishReason.ABORT))

    def is_healthy(self) -> bool:
        """The engine thread is alive, its last step did not fail (recently), and, if it has work, it finished
        a step recently."""
        if not self.ready or not self._thread.is_alive() or self.engine.core.rank_failure() is not None:
            return False
        now_s = time.monotonic()
        if self._num_failed_steps_in_a_row and now_s - self._last_failure_s < self.unhealthy_after_failure_s:
            return False
        return self._num_in_flight == 0 or now_s - self._last_progress_s < self.stall_timeout_s

    def fatal_error(self) -> str | None:
        """Why the engine can serve no more (it stopped, or a tensor-parallel rank exited); None while it can."""
        if self.startup_error is not None:
            return f"start-up failed ({self.progress.current}): {self.startup_error}"
        if not self.ready:
            return None
        return self.failure or self.engine.core.rank_failure()

    def stop_accepting(self) -> None:
        with self._lock:
            self._refusal = "the server is shutting down"

    def shutdown(self) -> None:
        """Fail whatever is still in flight and stop the engine thread."""
        with self._lock:  # with `generate` under the same lock, no request is queued behind the stop command
            self._refusal = "the server is shutting down"
            self._commands.put(None)
        # A build under way is not waited for, nor a stuck step: the thread is a daemon, and dies with the process.
        if self.ready and not self._stuck:
            self._thread.join(timeout=10)

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

    def _on_step(self, result: StepResult) -> None:
        """On the event loop: a step's tokens become the requests' deltas."""
        processed = self.outputs.process(result.outputs)
        for delta in processed.deltas:
            stream = self._streams.pop(delta.request_id) if delta.finished else self._streams.get(delta.request_id)
            if stream is None:
                continue
            stream.add(delta)
            self._num_in_flight -= delta.finished
        for request_id in processed.stopped:
            self._commands.put(_Finish(request_id, FinishReason.STOP))

    def _on_failure(self, request_ids: list[str], error: Exception) -> None:
        """On the event loop: fail these requests' streams."""
        for request_id in request_ids:
            self.outputs.abort(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._num_in_flight -= 1
                stream.set_error(error)

    def _post(self, callback: Callable, *args) -> None:
        """Run `callback(*args)` on the event loop (if it still runs: a stopped server has nobody to tell)."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(callback, *args)

    # The engine thread

    def _run(self, make_engine: Callable[[StartupProgress], LLMEngine]) -> None:
        try:
            self.engine = make_engine(self.progress)
            self.inputs, self.outputs = self.engine.inputs, self.engine.outputs
            loras = self.engine.core.loras
            self._loras = {tag.name: tag for tag in loras.loaded()} if loras is not None else {}
            self._report_stats()  # the KV cache's size and empty queues, before any request
            self._state = self._take_state()
        except BaseException as error:  # re-raised by the constructor, or reported by `fatal_error`
            self.startup_error = error
            return
        finally:
            self._ready.set()
        watchdog = None
        if self.engine.core.is_tensor_parallel:
            limit_s = STUCK_AFTER_TIMEOUTS * self.engine.core.config.tensor_parallel_timeout_s
            watchdog = StepWatchdog(limit_s, self.engine.core.ranks.group.progress, self._on_stuck_step)
        try:
            self._loop_steps(watchdog)
        finally:
            if watchdog is not None:
                watchdog.close()
            self.engine.close()

    def _loop_steps(self, watchdog: StepWatchdog | None) -> None:
        core = self.engine.core
        while self._apply_commands(block=not core.has_unfinished()):
            start_s = time.monotonic()
            try:
                if watchdog is not None:
                    watchdog.step_started()
                result = core.step()
            except Exception as error:  # a failed step must not kill the loop or strand clients
                logger.exception("engine step failed; failing the requests in flight")
                if self._step_failed(error):
                    return
                continue
            finally:
                if watchdog is not None:
                    watchdog.step_ended()
            if result.ran_model:  # only a step that ran the model shows it works
                self._num_failed_steps_in_a_row = 0
            self._last_progress_s = time.monotonic()
            self._stats.stepped(result, start_s, self._last_progress_s)
            self._report_stats()
            if result.outputs:
                self._post(self._on_step, result)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued adds and finishes (waiting for one if `block`); returns False on shutdown."""
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

    def _apply(self, command: _Add | _Finish | _TakeState | _LoadLora | _UnloadLora) -> None:
        core = self.engine.core
        if isinstance(command, _TakeState):
            if self._state.taken_at_monotonic_s < command.asked_at_s:
                self._state = self._take_state()
            _answer(command.future, self._state)
        elif isinstance(command, _LoadLora):
            _answer(command.future, self._load_lora(command))
        elif isinstance(command, _UnloadLora):
            core.remove_lora(command.name)
        elif isinstance(command, _Finish):
            if core.finish(command.request_id, command.reason):
                self._stats.finished(command.request_id, command.reason.value)
        else:
            request_id = command.request.request_id
            self._stats.arrived(request_id, len(command.request.prompt_token_ids), command.arrival_s)
            try:
                core.add(command.request)
            except Exception as error:  # checked by the input processor; anything left is reported, not raised
                logger.exception("request %s could not be queued", request_id)
                self._stats.finished(request_id, "error")
                self._post(self._on_failure, [request_id], error)

    def _load_lora(self, command: _LoadLora) -> AdapterTag | Exception:
        core = self.engine.core
        try:
            if command.replace:
                core.remove_lora(command.adapter.name)
            return core.add_lora(command.adapter)
        except Exception as error:  # the adapter's fault (it does not fit the model): the asker's error
            return error

    def _step_failed(self, error: Exception) -> bool:
        """Fail the requests in flight; True if that was one failed step too many and the loop must end."""
        self._num_failed_steps_in_a_row += 1
        self._last_failure_s = time.monotonic()
        self._fail_all(EngineStepError(STEP_FAILED_MESSAGE))
        self._report_stats()
        core = self.engine.core
        if core.is_tensor_parallel:  # a collective failed or was cut short: the ranks are out of step
            failure = self.failure or core.rank_failure() or f"a tensor-parallel step failed ({error})"
            core.kill_ranks()  # nothing to wait for: a hung rank would not hear a stop
        elif self._num_failed_steps_in_a_row < self.max_consecutive_step_failures:
            return False
        else:
            failure = f"{self._num_failed_steps_in_a_row} model steps failed in a row"
        logger.error("%s; the engine stops", failure)
        self._stop(EngineUnavailableError(f"the engine stopped: {failure}"))
        self.failure, self.failed = failure, True
        return True

    def _on_stuck_step(self, failure: str) -> None:
        """From the watchdog's thread: a tensor-parallel step is stuck. The engine has failed (the server exits on
        it), every request in flight gets its error now (the engine thread may never come back to fail them), and
        killing the other ranks fails the collective the step may wait in."""
        logger.error("%s; the engine stops", failure)
        with self._lock:
            self._refusal = f"the engine stopped: {failure}"
        self.failure, self.failed, self._stuck = failure, True, True
        self._post(self._fail_streams, EngineUnavailableError(f"the engine stopped: {failure}"))
        self.engine.core.kill_rank_processes()

    def _fail_streams(self, error: Exception) -> None:
        """On the event loop: fail every request's stream."""
        self._on_failure(list(self._streams), error)

    def _stop(self, error: Exception) -> None:
        """Refuse new requests, then fail every request in flight and every one still queued."""
        with self._lock:
            self._refusal = str(error)
        self._fail_all(error)
        queued = []
        while True:  # after the refusal no request is queued any more, so this ends
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                queued.append(command.request.request_id)
            elif isinstance(command, _LoadLora):
                _answer(command.future, error)
        self._post(self._on_failure, queued, error)

    def _fail_all(self, error: Exception) -> None:
        request_ids = self.engine.core.finish_all()
        for request_id in request_ids:
            self._stats.finished(request_id, "error")
        self._num_running = 0
        self._post(self._on_failure, request_ids, error)

    def _report_stats(self) -> None:
        core = self.engine.core
        expert_tokens = None
        now_s = time.monotonic()
        # A read waits for the device: about once a second, and when the engine goes idle (all counted).
        if now_s - self._expert_tokens_read_s >= EXPERT_TOKENS_INTERVAL_S or not core.has_unfinished():
            expert_tokens, self._expert_tokens_read_s = core.take_expert_tokens(), now_s
        # Collected even unread: nothing piles up.
        stats = self._stats.collect(core.queue_stats(), expert_tokens, core.num_dropped_kv_events)
        self._num_running = stats.num_running
        self._stats_window.record(stats, now_s)
        if self._on_stats is not None:
            self._on_stats(stats)

    def _take_state(self) -> EngineState:
        """Engine thread only, between steps: the one place the console reads the scheduler and the allocator."""
        return self.engine.core.engine_state(self._stats_window, time.monotonic(), time.time())
