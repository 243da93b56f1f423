"""Engine faults behind a live server, over loopback: model steps that raise or hang, injected with the test-only
hook of testing/fault_injection.py.

A failed step answers the requests in flight with 500 (or an SSE error chunk, then [DONE]) in words that name no
file; /health is 503 until a step succeeds again; after `max_consecutive_step_failures` failed steps in a row the
engine stops and every request gets 503 (`kvserve serve` then exits with status 1: tests/test_server_process.py).
A step that hangs while requests wait turns /health 503 too. Every wait is bounded.
"""

import asyncio
import json
import threading
import time

import httpx
import pytest

from kvserve.engine import RequestDelta
from kvserve.engine.async_engine import RequestStream
from kvserve.testing.fault_injection import FaultPlan, FaultyExecute
from tests.server_harness import (
    TINY_MODEL,
    RunningServer,
    assert_error_object,
    assert_nothing_allocated,
    assert_openai_error,
    tiny_server,
    wait_for,
)

COMPLETIONS = "/v1/completions"
COMPLETION = {"model": TINY_MODEL, "prompt": "Once upon a time", "max_tokens": 2}
LONG_COMPLETION = {**COMPLETION, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
REQUEST_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def fragile(tiny_checkpoints):
    """A server of its own: its model steps are made to fail."""
    with tiny_server(tiny_checkpoints) as running:
        yield running


def inject(running: RunningServer, monkeypatch, plan: FaultPlan) -> FaultyExecute:
    """Counts steps from now; undone at the end of the test."""
    faulty = FaultyExecute(running.engine.core.runner.execute, plan)
    monkeypatch.setattr(running.engine.core.runner, "execute", faulty)
    return faulty


def health(running: RunningServer) -> int:
    return httpx.get(running.base_url + "/health", timeout=REQUEST_TIMEOUT_S).status_code


def post(running: RunningServer, body: dict) -> httpx.Response:
    return httpx.post(running.base_url + COMPLETIONS, json=body, timeout=REQUEST_TIMEOUT_S)


def assert_names_no_internals(error: dict) -> None:
    """The client learns that the step failed, never the exception, a file or a traceback."""
    assert error["type"] == "internal_error"
    for leak in ("injected", ".py", "/", "Traceback"):
        assert leak not in error["message"], error["message"]


def assert_recovered(running: RunningServer) -> None:
    assert_nothing_allocated(running)
    response = post(running, COMPLETION)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == COMPLETION["max_tokens"]
    assert health(running) == 200
    assert_nothing_allocated(running)


def test_a_failing_step_answers_500_and_health_is_503_until_a_step_succeeds(fragile, monkeypatch):
    inject(fragile, monkeypatch, FaultPlan("raise", first_step=3, num_steps=1))
    errors_before = fragile.metric("requests_finished_total", finished_reason="error")

    response = post(fragile, {**COMPLETION, "max_tokens": 20})

    assert_names_no_internals(assert_openai_error(response, 500))
    assert health(fragile) == 503
    assert fragile.metric("requests_finished_total", finished_reason="error") == errors_before + 1
    assert_recovered(fragile)


def test_a_reader_slower_than_the_engine_gets_the_tokens_made_before_a_failure_then_the_error():
    async def read_after_both_arrived() -> list:
        stream = RequestStream()
        stream.add(RequestDelta("r", [5], "a", None, None))
        stream.add(RequestDelta("r", [6], "b", None, None))
        stream.set_error(RuntimeError("step failed"))
        got = []
        with pytest.raises(RuntimeError, match="step failed"):
            async for delta in stream:
                got.append((delta.token_ids, delta.text))
        return got

    assert asyncio.run(read_after_both_arrived()) == [([5, 6], "ab")]


def test_a_failing_step_ends_a_stream_with_an_error_chunk_then_done(fragile, monkeypatch):
    inject(fragile, monkeypatch, FaultPlan("raise", first_step=8, num_steps=1))
    with (
        httpx.Client(base_url=fragile.base_url, timeout=REQUEST_TIMEOUT_S) as client,
        client.stream("POST", COMPLETIONS, json={**LONG_COMPLETION, "stream": True}) as response,
    ):
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]

    assert events[-1] == "[DONE]"
    error_event = json.loads(events[-2])
    assert list(error_event) == ["error"]
    assert_names_no_internals(assert_error_object(error_event["error"]))
    text_events = [json.loads(event) for event in events[:-2]]
    assert text_events and all(event["choices"][0]["finish_reason"] is None for event in text_events)
    assert_recovered(fragile)


def test_without_traffic_health_turns_200_again_once_the_failure_is_old(fragile, monkeypatch):
    # So a load balancer that stopped sending requests because of the 503 lets traffic back to try again.
    monkeypatch.setattr(fragile.ctx.engine, "unhealthy_after_failure_s", 0.5)
    inject(fragile, monkeypatch, FaultPlan("raise", first_step=0, num_steps=1))
    assert_openai_error(post(fragile, COMPLETION), 500)
    assert health(fragile) == 503

    wait_for(lambda: health(fragile) == 200)
    assert_recovered(fragile)


def test_failed_steps_in_a_row_stop_the_engine_and_every_later_request_gets_503(tiny_checkpoints, monkeypatch):
    with tiny_server(tiny_checkpoints, max_consecutive_step_failures=2) as running:
        inject(running, monkeypatch, FaultPlan("raise", first_step=0))  # every step fails
        assert_names_no_internals(assert_openai_error(post(running, COMPLETION), 500))
        assert not running.ctx.engine.failed

        assert_names_no_internals(assert_openai_error(post(running, COMPLETION), 500))
        wait_for(lambda: running.ctx.engine.failed)

        refused = assert_openai_error(post(running, COMPLETION), 503)
        assert "stopped" in refused["message"]
        assert health(running) == 503
        assert running.ctx.engine.num_in_flight == 0


def test_a_hung_step_turns_health_503_while_requests_wait_and_200_once_it_moves_again(tiny_checkpoints, monkeypatch):
    stall_timeout_s = 0.5
    with tiny_server(tiny_checkpoints, engine_stall_timeout_s=stall_timeout_s) as stalling:
        time.sleep(stall_timeout_s + 0.1)
        assert health(stalling) == 200  # nothing waits: an idle engine is not a hung one
        hang = inject(stalling, monkeypatch, FaultPlan("hang", first_step=0, num_steps=1))
        responses: list[httpx.Response] = []
        client = threading.Thread(target=lambda: responses.append(post(stalling, COMPLETION)), daemon=True)
        client.start()
        try:
            wait_for(lambda: health(stalling) == 503)
            assert not responses  # the request is stuck behind the hung step
        finally:
            hang.release()
        client.join(REQUEST_TIMEOUT_S)

        assert [response.status_code for response in responses] == [200]
        wait_for(lambda: health(stalling) == 200)
        assert_recovered(stalling)


@pytest.mark.parametrize(
    ("text", "plan"),
    [
        ("raise:3", FaultPlan("raise", 3, None)),
        ("raise:0:2", FaultPlan("raise", 0, 2)),
        ("hang:5", FaultPlan("hang", 5, 1)),
    ],
)
def test_the_fault_injection_variable_parses_into_a_plan(text, plan):
    assert FaultPlan.parse(text) == plan


@pytest.mark.parametrize("text", ["raise", "explode:1", "raise:x", "hang:1:2:3", "raise:-1"])
def test_a_malformed_fault_injection_variable_is_refused(text):
    with pytest.raises(ValueError, match="KVSERVE_FAULT_INJECTION"):
        FaultPlan.parse(text)
