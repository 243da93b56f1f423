"""Bad requests to the HTTP server: each gets a precise 4xx in OpenAI's error shape, naming the offending
parameter, and leaves the server serving the next request with no KV block held. Never a 500 for bad input.

Statuses that are not 400: an unknown model and an unknown route are 404, a body over `max_body_bytes` is
413, too many or too large headers are 431, and a GET on a POST route is 405. A wrong Content-Type is a 400
(the body is not read as JSON), not a 415, as in OpenAI's API. The one answer not in OpenAI's shape: a request
head still incomplete beyond uvicorn's own cap (64 KiB), which uvicorn refuses with a plain-text 400 before the
app sees it.
No error message names a server file or carries a traceback.
"""

import http.client
import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from kvserve.server.request_limits import MAX_HEADER_BYTES, MAX_HEADER_FIELD_BYTES, MAX_HEADERS
from kvserve.server.serve import MAX_INCOMPLETE_EVENT_BYTES
from tests.server_harness import assert_openai_error

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODEL = "tiny-llama"
CONTEXT_LEN = 512  # max_position_embeddings of the tiny Llama
VOCAB_SIZE = 512
MAX_N = 16  # ServerSettings defaults
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_BODY_BYTES = 1 << 20
MAX_PROMPTS = 64
VALID_COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}
VALID_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


def token_ids(num_tokens: int) -> list[int]:
    """A prompt of `num_tokens` ids, all inside the vocabulary."""
    return [4 + i % (VOCAB_SIZE - 4) for i in range(num_tokens)]


@pytest.fixture(scope="module")
def client(server):
    # One keep-alive connection for the module: an error response must not cost the client its connection.
    with httpx.Client(base_url=server.base_url, timeout=30, limits=httpx.Limits(max_connections=1)) as client:
        yield client


def assert_refused(server, client, response, status: int, param: str | None = None) -> dict:
    """The error is `status` in OpenAI's shape, naming no server file; afterwards a valid request succeeds and no
    block stays held."""
    error = assert_openai_error(response, status, param)
    assert_names_no_internals(error["message"])
    assert client.post(COMPLETIONS, json=VALID_COMPLETION).status_code == 200
    server.wait_until_idle()
    assert server.engine.kv_usage().num_used_blocks == 0
    return error


def assert_names_no_internals(message: str) -> None:
    for leak in ("Traceback", '.py"', ".py:", "/work/", "/tmp/", "site-packages", "/home/", "/root/"):
        assert leak not in message, message


# The context window


def test_prompt_plus_max_tokens_beyond_the_context_window_is_refused_with_both_counts(server, client):
    response = client.post(COMPLETIONS, json={"model": MODEL, "prompt": token_ids(100), "max_tokens": 413})
    error = assert_refused(server, client, response, 400, param="max_tokens")
    assert "100" in error["message"] and "413" in error["message"] and str(CONTEXT_LEN) in error["message"]


def test_a_prompt_and_max_tokens_that_exactly_fill_the_context_window_are_served(client):
    response = client.post(COMPLETIONS, json={"model": MODEL, "prompt": token_ids(CONTEXT_LEN - 1), "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == {"prompt_tokens": 511, "completion_tokens": 1, "total_tokens": 512}


@pytest.mark.parametrize("num_prompt_tokens", [CONTEXT_LEN, 600])
def test_a_prompt_that_leaves_no_room_for_output_is_refused(server, client, num_prompt_tokens):
    response = client.post(COMPLETIONS, json={"model": MODEL, "prompt": token_ids(num_prompt_tokens)})
    error = assert_refused(server, client, response, 400, param="prompt")
    assert str(num_prompt_tokens) in error["message"] and str(CONTEXT_LEN) in error["message"]


def test_chat_max_tokens_beyond_the_context_window_is_refused(server, client):
    response = client.post(CHAT, json={**VALID_CHAT, "max_tokens": CONTEXT_LEN})
    assert_refused(server, client, response, 400, param="max_tokens")


# Sampling fields out of range (the engine's checks, reported by field)

OUT_OF_RANGE = {
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens -1": ({"max_tokens": -1}, "max_tokens"),
    "max_tokens 2**63": ({"max_tokens": 2**63}, "max_tokens"),
    "min_tokens above max_tokens": ({"min_tokens": 3}, "min_tokens"),
    "temperature -1": ({"temperature": -1}, "temperature"),
    "top_p 0": ({"top_p": 0}, "top_p"),
    "top_p 1.5": ({"top_p": 1.5}, "top_p"),
    "top_k -2": ({"top_k": -2}, "top_k"),
    "min_p 1.5": ({"min_p": 1.5}, "min_p"),
    "min_p -0.1": ({"min_p": -0.1}, "min_p"),
    "presence_penalty 3": ({"presence_penalty": 3}, "presence_penalty"),
    "frequency_penalty 3": ({"frequency_penalty": 3}, "frequency_penalty"),
    "repetition_penalty 0": ({"repetition_penalty": 0}, "repetition_penalty"),
    "seed 2**64": ({"seed": 2**64}, "seed"),
    "logprobs 21": ({"logprobs": 21}, "logprobs"),
    "logprobs -1": ({"logprobs": -1}, "logprobs"),
    "empty stop string": ({"stop": [""]}, "stop"),
    "stop token id -1": ({"stop_token_ids": [-1]}, "stop_token_ids"),
    "stop token id = vocab size": ({"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
}


@pytest.mark.parametrize(("fields", "param"), OUT_OF_RANGE.values(), ids=OUT_OF_RANGE.keys())
def test_an_out_of_range_sampling_field_is_a_400_naming_it(server, client, fields, param):
    response = client.post(COMPLETIONS, json={**VALID_COMPLETION, **fields})
    assert_refused(server, client, response, 400, param=param)


NON_FINITE = [("temperature", "NaN"), ("temperature", "Infinity"), ("temperature", "-Infinity"), ("top_p", "NaN")]


@pytest.mark.parametrize(("field", "literal"), NON_FINITE, ids=[f"{f} {v}" for f, v in NON_FINITE])
def test_a_non_finite_number_is_a_400_naming_its_field(server, client, field, literal):
    # json.dumps refuses NaN and Infinity; clients that send them write the literals by hand.
    body = f'{{"model": "{MODEL}", "prompt": "Hi", "max_tokens": 2, "{field}": {literal}}}'
    response = client.post(COMPLETIONS, content=body, headers={"content-type": "application/json"})
    error = assert_refused(server, client, response, 400, param=field)
    assert "finite" in error["message"]


@pytest.mark.parametrize("fields", [{"top_p": 1}, {"top_k": -1}, {"top_k": 2**64}, {"min_p": 1}, {"temperature": 0}])
def test_the_edges_of_the_sampling_ranges_are_served(server, client, fields):
    # top_k beyond the vocabulary keeps every token; 2**64 once overflowed in the sampler and failed the whole batch.
    response = client.post(COMPLETIONS, json={**VALID_COMPLETION, **fields})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


# JSON types are taken strictly: only an integer may stand for a float

WRONG_TYPES = {
    "max_tokens as a string": ({"max_tokens": "5"}, "max_tokens"),
    "n as a whole float": ({"n": 2.0}, "n"),
    "stream as 1": ({"stream": 1}, "stream"),
    "echo as a string": ({"echo": "true"}, "echo"),
    "a boolean stop token id": ({"stop_token_ids": [True]}, "stop_token_ids.0"),
    "temperature as a string": ({"temperature": "0.5"}, "temperature"),
}


@pytest.mark.parametrize(("fields", "param"), WRONG_TYPES.values(), ids=WRONG_TYPES.keys())
def test_a_value_of_the_wrong_json_type_is_a_400_naming_its_field(server, client, fields, param):
    response = client.post(COMPLETIONS, json={**VALID_COMPLETION, **fields})
    assert_refused(server, client, response, 400, param=param)


# Prompts and messages

BAD_PROMPTS = {
    "empty string": "",
    "empty list": [],
    "list of an empty list": [[]],
    "empty second prompt": ["Hi", ""],
    "token id -1": [-1],
    "token id = vocab size": [VOCAB_SIZE],
    "token id -1 in a batch": [[5], [-1]],
    "a number": 5,
    "an object": {"text": "Hi"},
    "a float token id": [1.5],
    "a boolean token id": [True],
    "a whole float as a token id": [5.0],
    "more than max_prompts prompts": ["Hi"] * (MAX_PROMPTS + 1),
    "more than max_prompts token-id prompts": [[5]] * (MAX_PROMPTS + 1),
}


@pytest.mark.parametrize("prompt", BAD_PROMPTS.values(), ids=BAD_PROMPTS.keys())
def test_an_empty_or_out_of_vocabulary_prompt_is_a_400_naming_the_prompt(server, client, prompt):
    response = client.post(COMPLETIONS, json={**VALID_COMPLETION, "prompt": prompt})
    assert_refused(server, client, response, 400, param="prompt")


BAD_CHATS = {
    "empty messages": ({"messages": []}, "messages"),
    "no messages": ({"messages": None}, "messages"),
    "a tool message without the call it answers": (
        {"messages": [{"role": "tool", "content": "Hi"}]},
        "messages.0.tool_call_id",
    ),
    "an unknown role": ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages.0.role"),
    "a number as content": ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    "an image part": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages.0.content.0.type",
    ),
    "an audio part": (
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]},
        "messages.0.content.0.type",
    ),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, "top_logprobs"),
    "top_logprobs 21": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "top_logprobs -1": ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
}


@pytest.mark.parametrize(("fields", "param"), BAD_CHATS.values(), ids=BAD_CHATS.keys())
def test_a_bad_chat_request_is_a_400_naming_the_field(server, client, fields, param):
    response = client.post(CHAT, json={**VALID_CHAT, **fields})
    assert_refused(server, client, response, 400, param=param)


# The server's own limits

SERVER_LIMITS = {
    "n 0": ({"n": 0}, "n"),
    "n above max_n": ({"n": MAX_N + 1}, "n"),
    "too many stop strings": ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    "a too-long stop string": ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
}


@pytest.mark.parametrize(("fields", "param"), SERVER_LIMITS.values(), ids=SERVER_LIMITS.keys())
def test_a_request_over_a_server_limit_is_a_400_naming_the_field(server, client, fields, param):
    response = client.post(COMPLETIONS, json={**VALID_COMPLETION, **fields})
    assert_refused(server, client, response, 400, param=param)


def test_an_unknown_model_is_a_404_naming_the_model(server, client):
    for route, body in [(COMPLETIONS, VALID_COMPLETION), (CHAT, VALID_CHAT)]:
        response = client.post(route, json={**body, "model": "gpt-4"})
        error = assert_refused(server, client, response, 404, param="model")
        assert error["code"] == "model_not_found" and "gpt-4" in error["message"]


# Bodies that are not a JSON request object

BAD_BODIES = {
    "malformed JSON": b'{"prompt": "Hi",',
    "a JSON array": b'["Hi"]',
    "a JSON string": b'"Hi"',
    "JSON null": b"null",
    "an empty body": b"",
    "invalid UTF-8": b'{"prompt": "\xff\xfe", "max_tokens": 2}',
}


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_a_body_that_is_not_a_json_object_is_a_400(server, client, body, route):
    response = client.post(route, content=body, headers={"content-type": "application/json"})
    assert_refused(server, client, response, 400)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_with_a_wrong_content_type_is_a_400(server, client, content_type, route):
    body = VALID_COMPLETION if route == COMPLETIONS else VALID_CHAT
    response = client.post(route, content=json.dumps(body), headers={"content-type": content_type})
    assert_refused(server, client, response, 400)


def test_the_prompt_list_may_hold_max_prompts_prompts(client):
    response = client.post(COMPLETIONS, json={**VALID_COMPLETION, "prompt": ["Hi"] * MAX_PROMPTS, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == MAX_PROMPTS


# (GET / is the console's redirect: tests/test_console.py.)
@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/nothing"), ("POST", "/v1/engines"), ("GET", "/nothing")])
def test_an_unknown_route_is_a_404_in_the_same_shape(server, client, method, path):
    assert_refused(server, client, client.request(method, path), 404)


def test_a_get_on_a_post_route_is_a_405_in_the_same_shape(server, client):
    assert_refused(server, client, client.get(COMPLETIONS), 405)


def _oversized_body() -> bytes:
    body = json.dumps({**VALID_COMPLETION, "prompt": "a" * MAX_BODY_BYTES}).encode()
    assert len(body) > MAX_BODY_BYTES
    return body


def test_a_body_over_max_body_bytes_is_a_413_by_its_content_length(server, client):
    response = client.post(COMPLETIONS, content=_oversized_body(), headers={"content-type": "application/json"})
    assert_refused(server, client, response, 413)


def test_a_chunked_body_over_max_body_bytes_is_a_413(server, client):
    body = _oversized_body()
    chunks = (body[i : i + 64 * 1024] for i in range(0, len(body), 64 * 1024))  # a generator: no Content-Length
    response = client.post(COMPLETIONS, content=chunks, headers={"content-type": "application/json"})
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert_refused(server, client, response, 413)


def test_a_body_over_max_body_bytes_is_refused_before_the_client_sends_it(server, client):
    # Only the head and a first kilobyte go out; the 413 must come back without the server waiting for the rest.
    address = urlsplit(server.base_url)
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {100 * MAX_BODY_BYTES}\r\n\r\n"
    )
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"prompt": "' + b"a" * 1024)
        status_line, body = _read_response(sock)
    assert status_line.startswith("HTTP/1.1 413"), status_line
    assert json.loads(body)["error"]["type"] == "request_too_large"
    assert client.post(COMPLETIONS, json=VALID_COMPLETION).status_code == 200


def _read_response(sock: socket.socket) -> tuple[str, bytes]:
    """The status line and body of one HTTP/1.1 response with a Content-Length (the socket's timeout bounds it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"connection closed mid-head: {data!r}")
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length:"))
    while len(body) < length:
        body += sock.recv(65536) or pytest.fail(f"connection closed mid-body: {body!r}")
    return lines[0], body


def test_a_chunked_body_under_max_body_bytes_is_served(client):
    body = json.dumps(VALID_COMPLETION).encode()
    chunks = iter([body[:10], body[10:]])
    response = client.post(COMPLETIONS, content=chunks, headers={"content-type": "application/json"})
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert response.status_code == 200, response.text


# Headers

BAD_HEADERS = {
    "too many headers": {f"x-h{i}": "1" for i in range(MAX_HEADERS + 1)},
    "one oversized header": {"x-big": "a" * (MAX_HEADER_FIELD_BYTES + 1)},
    "oversized headers together": {f"x-h{i}": "a" * (MAX_HEADER_FIELD_BYTES - 100) for i in range(5)},
}


@pytest.mark.parametrize("route", [COMPLETIONS, "/v1/models"])
@pytest.mark.parametrize("headers", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_too_many_or_too_large_headers_are_a_431(server, client, headers, route):
    assert sum(len(k) + len(v) for k, v in headers.items()) < MAX_INCOMPLETE_EVENT_BYTES  # so the app answers
    response = client.request("POST" if route == COMPLETIONS else "GET", route, json=VALID_COMPLETION,
                              headers=headers)  # fmt: skip
    error = assert_refused(server, client, response, 431)
    assert error["type"] == "request_too_large"


def test_headers_within_the_limits_are_served(client):
    headers = {f"x-h{i}": "a" * 100 for i in range(MAX_HEADERS - 20)}  # room for httpx's own headers
    assert sum(len(k) + len(v) for k, v in headers.items()) < MAX_HEADER_BYTES
    assert client.post(COMPLETIONS, json=VALID_COMPLETION, headers=headers).status_code == 200


def test_a_request_head_beyond_uvicorns_cap_is_refused_by_uvicorn_and_the_server_serves_on(server):
    # h11 trips only on a head still incomplete beyond its cap, and one socket read takes up to 256 KiB: 1 MB
    # of headers always trips it, whatever arrives in which read.
    headers = {f"x-h{i}": "a" * 8000 for i in range(128)}
    with httpx.Client(base_url=server.base_url, timeout=30) as fresh:
        try:
            response = fresh.post(COMPLETIONS, json=VALID_COMPLETION, headers=headers)
            assert (response.status_code, response.headers.get("connection")) == (400, "close")
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
            pass  # uvicorn answered and closed while the client was still sending: the client sees a reset
        assert fresh.post(COMPLETIONS, json=VALID_COMPLETION).status_code == 200
    server.wait_until_idle()
    assert server.engine.kv_usage().num_used_blocks == 0


# The connection and the whole input space


def test_an_error_response_keeps_the_keep_alive_connection_open(server):
    # Errors the app did not register a handler for went to Starlette's catch-all, which answered and then
    # re-raised: uvicorn logged a traceback and closed the connection, so the next request on it failed.
    address = urlsplit(server.base_url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    headers = {"content-type": "application/json"}
    try:
        for body, status in [({**VALID_COMPLETION, "max_tokens": 0}, 400), (VALID_COMPLETION, 200)]:
            connection.request("POST", COMPLETIONS, body=json.dumps(body), headers=headers)
            response = connection.getresponse()
            response.read()
            assert response.status == status
            assert response.getheader("connection") != "close"
        assert connection.sock is not None  # http.client reopens silently only after a "Connection: close"
    finally:
        connection.close()


WRONG_VALUES = [None, True, "x", [], {}, -1, 2**64, 1e308, -1e308, [2**64], ["x"], [None]]
COMPLETION_FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
    "frequency_penalty", "stream", "stream_options", "user", "top_k", "min_p", "repetition_penalty",
    "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens", "logprobs", "echo", "best_of", "suffix",
    "logit_bias", "prompt_logprobs", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar",
]  # fmt: skip
CHAT_FIELDS = [
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt", "tools", "tool_choice",
    "parallel_tool_calls", "response_format", "modalities", "service_tier", "store", "audio", "metadata",
]  # fmt: skip


def test_no_wrongly_typed_or_extreme_value_in_any_field_is_a_server_error(server, client):
    requests = [(COMPLETIONS, VALID_COMPLETION, field) for field in COMPLETION_FIELDS]
    requests += [(CHAT, VALID_CHAT, field) for field in CHAT_FIELDS]
    answers = {}
    for route, valid, field in requests:
        for value in WRONG_VALUES:
            if field in ("max_tokens", "max_completion_tokens") and value is None:
                continue  # valid, and fills the whole context window: slow, and no error case
            response = client.post(route, json={**valid, field: value})
            answers[(route, field, repr(value))] = response.status_code
            if response.status_code != 200:
                assert_openai_error(response, response.status_code, param=response.json()["error"]["param"])
    assert {key: status for key, status in answers.items() if not 200 <= status < 500} == {}
    assert sum(status == 400 for status in answers.values()) > len(answers) // 2
    server.wait_until_idle()
    assert server.engine.kv_usage().num_used_blocks == 0
