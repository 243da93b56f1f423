"""schemathesis against the live server's own /openapi.json: every operation gets generated requests, both valid
per the schema and not, and every response is checked: no 5xx, a documented status, content type, headers and
body schema (errors included), and invalid requests refused with a 4xx.

FUZZ_EXAMPLES examples per operation and generation mode in the default run (about half a minute);
`KVSERVE_FUZZ_EXAMPLES=500 pytest -s tests/test_fuzz_openapi.py` for a longer run. Each run prints how many cases
ran per operation.
"""

import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import ServerError
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvserve.testing.fault_injection import FaultPlan, FaultyExecute
from tests.server_harness import assert_nothing_allocated, tiny_server

FUZZ_EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", "50"))
# A short context bounds what a generated request can ask for (max_tokens null means "the rest of the context").
FUZZ_MAX_MODEL_LEN = 64
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
CASES_RUN: Counter = Counter()
OPERATIONS = [
    "GET /health", "GET /metrics", "GET /version", "GET /v1/models", "GET /v1/models/{model_id}",
    "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize", "GET /v1/engine/state",
    "POST /v1/responses", "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
    "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/embeddings",
]  # fmt: skip
STREAMING = ["POST /v1/completions", "POST /v1/chat/completions"]
# Requests that break the schema exist only where there is a body to break; streamed runs hold every SSE event
# to the schema of its data (a chunk, an error or [DONE]).
RUNS = (
    [(operation, "positive") for operation in OPERATIONS]
    + [(operation, "negative") for operation in OPERATIONS if operation.startswith("POST")]
    + [(operation, "streamed") for operation in STREAMING]
)


@pytest.fixture(scope="module")
def live(tiny_checkpoints):
    with tiny_server(tiny_checkpoints, max_model_len=FUZZ_MAX_MODEL_LEN) as running:
        yield running
        print(f"\nfuzzing: {sum(CASES_RUN.values())} cases, {dict(CASES_RUN)}")
        assert_nothing_allocated(running)


@pytest.fixture(scope="module")
def api_schema(live):
    return schemathesis.openapi.from_url(live.base_url + "/openapi.json")


def test_the_fuzzed_operations_are_every_operation_in_the_schema(api_schema):
    assert sorted(result.ok().label for result in api_schema.get_all_operations()) == sorted(OPERATIONS)


# Driven through `as_strategy` rather than schemathesis' pytest plugin, whose lazy loader breaks on pytest 9.2.
def stream(case):
    if isinstance(case.body, dict):
        case.body["stream"] = True
    return case


@pytest.mark.parametrize(("operation", "run"), RUNS, ids=[f"{operation} {run}" for operation, run in RUNS])
def test_no_generated_request_gets_a_5xx_or_a_response_outside_the_schema(api_schema, live, operation, run):
    method, path = operation.split()
    mode = GenerationMode.NEGATIVE if run == "negative" else GenerationMode.POSITIVE
    strategy = api_schema[path][method].as_strategy(generation_mode=mode)
    if run == "streamed":
        strategy = strategy.map(stream)

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(case=strategy)
    def fuzz(case) -> None:
        response = case.call(base_url=live.base_url, timeout=60)
        CASES_RUN[f"{operation} ({run})"] += 1
        case.validate_response(response, checks=CHECKS)

    fuzz()


def test_the_checks_fail_on_a_server_error(api_schema, live, monkeypatch):
    # The harness above would pass vacuously if the checks never looked at a response: here one must fail.
    runner = live.engine.core.runner
    monkeypatch.setattr(runner, "execute", FaultyExecute(runner.execute, FaultPlan("raise", 0)))
    case = api_schema["/v1/completions"]["POST"].Case(body={"prompt": "Hi", "max_tokens": 1})
    response = case.call(base_url=live.base_url, timeout=60)
    with pytest.RaisesGroup(ServerError, allow_unwrapped=True):
        case.validate_response(response, checks=CHECKS)
