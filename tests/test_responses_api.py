"""POST /v1/responses with the official `openai` SDK against a live server: the same tokens as the chat request it
stands for, typed stream events in order, structured output, function tools and their results sent back with
`previous_response_id`, the store (GET, DELETE, expiry, size), and every field of the SDK's `ResponseCreateParams`
served or refused by name."""

import json
import typing

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import response_create_params
from pydantic import BaseModel

from kvserve.server.response_store import ResponseStore
from kvserve.server.responses_protocol import ResponsesRequest
from tests.server_harness import TINY_MODEL, assert_nothing_allocated, assert_openai_error, tiny_server
from tests.test_tool_calling import SCHEMAS, WEATHER, _literal_regex

PROMPT = "Tell me about the river."
INSTRUCTIONS = "You answer in one line."
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER}
TIME_TOOL = {"type": "function", "name": "get_time", "parameters": SCHEMAS["get_time"]}
GREEDY = {"temperature": 0.0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def live(tiny_checkpoints, tokenizer, tmp_path_factory):
    from tests.test_tool_calling import TINY_CONFIGS, write_random_checkpoint

    config = TINY_CONFIGS["llama"](len(tokenizer))
    config.max_position_embeddings = 2048  # room for tool definitions, spelt out nearly character by character
    model = write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp("responses") / "llama", seed=7)
    with tiny_server({"llama": model}, tool_call_parser="hermes") as running:
        yield running
        running.wait_until_idle()
        assert_nothing_allocated(running)


@pytest.fixture
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0)


def chat_text(client, messages, **fields) -> str:
    fields = {"temperature": 0.0, "max_tokens": 12, **fields}
    return client.chat.completions.create(model=TINY_MODEL, messages=messages, **fields).choices[0].message.content


def test_a_response_is_the_chat_completion_of_its_instructions_and_input(client):
    response = client.responses.create(model=TINY_MODEL, input=PROMPT, instructions=INSTRUCTIONS, **GREEDY)
    expected = chat_text(client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": PROMPT}])
    assert response.output_text == expected
    assert response.object == "response" and response.model == TINY_MODEL and response.id.startswith("resp")
    (message,) = response.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")
    assert response.usage.output_tokens == 12 and response.usage.total_tokens == response.usage.input_tokens + 12
    assert (response.status, response.incomplete_details.reason, message.status) == (
        "incomplete", "max_output_tokens", "incomplete",
    )  # fmt: skip


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(client, live):
    prompt = "A prompt of its own, long enough to fill some blocks of the prefix cache: " + "the river bends " * 6
    first = client.responses.create(model=TINY_MODEL, input=prompt, **GREEDY)
    hits_before = live.metric("prefix_cache_hit_tokens_total")
    second = client.responses.create(model=TINY_MODEL, input=prompt, **GREEDY)
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert cached == live.metric("prefix_cache_hit_tokens_total") - hits_before > 0
    assert cached % live.engine.config.block_size == 0 and cached < second.usage.input_tokens
    assert second.output_text == first.output_text


def test_input_items_are_the_conversation(client):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
        {"role": "user", "content": PROMPT},
    ]  # fmt: skip
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": PROMPT}]  # fmt: skip
    assert client.responses.create(model=TINY_MODEL, input=items, **GREEDY).output_text == chat_text(client, messages)


def test_the_stream_sends_typed_events_in_order_and_adds_up_to_the_response(client):
    whole = client.responses.create(model=TINY_MODEL, input=PROMPT, temperature=0.0, max_output_tokens=10)
    events = list(client.responses.create(model=TINY_MODEL, input=PROMPT, temperature=0.0, max_output_tokens=10,
                                          stream=True))  # fmt: skip
    kinds = [event.type for event in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert events[-4].text == text
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


class Answer(BaseModel):
    city: typing.Literal["Paris", "Oslo", "Lima"]  # finite, so greedy random weights cannot loop on digits
    ok: bool


def test_the_sdks_stream_helper_parses_a_structured_answer_the_same_as_parse(client):
    # A structured answer ends with the grammar, so the response completes (the helper wants response.completed;
    # a response cut at max_output_tokens ends with response.incomplete, as OpenAI's does).
    fields = {"model": TINY_MODEL, "input": PROMPT, "text_format": Answer, "max_output_tokens": 60}
    parsed = client.responses.parse(temperature=0.0, **fields)
    with client.responses.stream(temperature=0.0, **fields) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    assert isinstance(final.output_parsed, Answer) and final.output_parsed == parsed.output_parsed


def test_text_format_json_schema_is_structured_output(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}  # fmt: skip
    text_format = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    for seed in range(3):
        response = client.responses.create(model=TINY_MODEL, input=PROMPT, text=text_format, max_output_tokens=60,
                                           temperature=1.0, extra_body={"seed": seed})  # fmt: skip
        jsonschema.validate(json.loads(response.output_text), schema)
        assert response.text.format.type == "json_schema"


def test_a_function_tool_round_trip_with_previous_response_id(client):
    first = client.responses.create(model=TINY_MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=80,
                                    temperature=1.0, extra_body={"seed": 1})  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "rain"}'}
    second = client.responses.create(model=TINY_MODEL, previous_response_id=first.id, input=[result],
                                     tools=[WEATHER_TOOL], tool_choice="none", **GREEDY)  # fmt: skip
    assert second.previous_response_id == first.id
    # The second turn's prompt is the whole conversation: the chat request with the same turns gives its tokens.
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"forecast": "rain"}'},
    ]  # fmt: skip
    assert second.output_text == chat_text(client, messages, tools=chat_tools, tool_choice="none")


def test_auto_streams_the_text_then_the_function_call(client):
    text = 'Let me check. <tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    forced = {"structured_outputs": {"regex": _literal_regex(text)}}
    fields = {"model": TINY_MODEL, "input": "Time?", "tools": [TIME_TOOL], "max_output_tokens": 200,
              "extra_body": forced}  # fmt: skip
    whole = client.responses.create(**fields)
    assert [item.type for item in whole.output] == ["message", "function_call"]
    assert whole.output[0].content[0].text == "Let me check."
    assert (whole.output[1].name, json.loads(whole.output[1].arguments)) == ("get_time", {"tz": "CET"})
    events = list(client.responses.create(stream=True, **fields))
    kinds = [event.type for event in events]
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.delta")
    added = [event.item.type for event in events if event.type == "response.output_item.added"]
    assert added == ["message", "function_call"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    assert json.loads(arguments) == json.loads(done.arguments) == {"tz": "CET"}
    assert [event.output_index for event in events if event.type == "response.output_item.done"] == [0, 1]
    assert kinds[-1] == "response.completed"
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]


def test_max_tool_calls_caps_the_calls_returned(client):
    response = client.responses.create(model=TINY_MODEL, input="Weather?", tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice="required", max_tool_calls=1, max_output_tokens=200,
                                       temperature=1.0, extra_body={"seed": 4})  # fmt: skip
    assert [item.type for item in response.output] == ["function_call"]


def test_logprobs_come_with_include(client):
    response = client.responses.create(model=TINY_MODEL, input=PROMPT, include=["message.output_text.logprobs"],
                                       top_logprobs=2, **GREEDY)  # fmt: skip
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == 12 and all(len(entry.top_logprobs) == 2 for entry in logprobs)
    chat = client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          temperature=0.0, max_tokens=12, logprobs=True, top_logprobs=2)  # fmt: skip
    expected = chat.choices[0].logprobs.content
    assert [e.token for e in logprobs] == [e.token for e in expected]
    assert [e.logprob for e in logprobs] == pytest.approx([e.logprob for e in expected], abs=1e-5)
    assert [[t.token for t in e.top_logprobs] for e in logprobs] == [
        [t.token for t in e.top_logprobs] for e in expected
    ]
    events = list(client.responses.create(model=TINY_MODEL, input=PROMPT, include=["message.output_text.logprobs"],
                                          top_logprobs=2, stream=True, **GREEDY))  # fmt: skip
    streamed = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    final = events[-1].response.output[0].content[0].logprobs
    assert [e.token for e in streamed] == [e.token for e in final] == [e.token for e in expected]


def test_stored_responses_are_got_deleted_and_not_kept_with_store_false(client, live):
    stored = client.responses.create(model=TINY_MODEL, input=PROMPT, **GREEDY)
    assert client.responses.retrieve(stored.id).output_text == stored.output_text
    assert client.responses.delete(stored.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)
    unstored = client.responses.create(model=TINY_MODEL, input=PROMPT, store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    response = httpx.post(live.base_url + "/v1/responses", timeout=30,
                          json={"model": TINY_MODEL, "input": "x", "previous_response_id": unstored.id})  # fmt: skip
    assert_openai_error(response, 400, "previous_response_id")


def test_the_store_keeps_the_newest_entries_for_their_lifetime():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    for index in range(3):
        store.put({"id": f"r{index}"}, [])
        now[0] += 4.0
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 2
    now[0] = 4.0 + 10.0  # r1 was stored at 4 s
    assert store.get("r1") is None and store.get("r2") is not None
    assert ResponseStore(max_entries=0, ttl_s=1.0).put({"id": "x"}, []) is None


def sdk_fields(params: type) -> set[str]:
    return set(typing.get_type_hints(params))


def test_every_field_the_openai_sdk_sends_is_declared():
    assert sdk_fields(response_create_params.ResponseCreateParamsBase) - set(ResponsesRequest.model_fields) == set()


REFUSED = {
    "background": True, "background_options": {"x": 1}, "conversation": "conv_1", "prompt": {"id": "pmpt_1"},
    "moderation": {"model": "omni"}, "image": {"size": "1024x1024"}, "access_programs": {"x": 1},
    "context_management": [{"type": "compaction"}], "prompt_cache_options": {"ttl": "1h"},
    "prompt_cache_retention": "24h", "reasoning": {"effort": "high", "summary": "auto"}, "truncation": "auto",
    "service_tier": "flex", "include": ["file_search_call.results"], "text": {"verbosity": "low"},
    "stream_options": {"include_obfuscation": False},
}  # fmt: skip
REFUSED_PARAMS = {"include": "include.0", "text": "text.verbosity", "reasoning": "reasoning.effort"}


@pytest.mark.parametrize(("field", "value"), REFUSED.items(), ids=list(REFUSED))
def test_fields_kvserve_does_not_serve_are_refused_by_name(live, field, value):
    response = httpx.post(live.base_url + "/v1/responses", json={"model": TINY_MODEL, "input": "x", field: value},
                          timeout=30)  # fmt: skip
    assert_openai_error(response, 400, REFUSED_PARAMS.get(field, field))


SERVED = {"store": False, "service_tier": "auto", "user": "u", "safety_identifier": "s", "prompt_cache_key": "k",
          "metadata": {"a": "b"}, "truncation": "disabled", "reasoning": {"effort": "none", "summary": "auto"},
          "parallel_tool_calls": True, "include": ["reasoning.encrypted_content"], "background": False}  # fmt: skip


def test_fields_asking_for_what_kvserve_does_are_served(live):
    body = {"model": TINY_MODEL, "input": "x", "max_output_tokens": 2, **SERVED}
    response = httpx.post(live.base_url + "/v1/responses", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == {"a": "b"} and response.json()["user"] == "u"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
        ({"input": "x", "tools": [{"type": "computer_use_preview", "display_width": 1}]}, "tools.0.type"),
        ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"input": "x", "temperatur": 1.0}, "temperatur"),
        ({"input": "x", "priority": 1}, "priority"),  # the server schedules first come, first served
        ({}, "input"),
        ({"input": "x", "model": "other"}, "model"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field(live, body, param):
    response = httpx.post(live.base_url + "/v1/responses", json={"model": TINY_MODEL, **body}, timeout=30)
    assert_openai_error(response, 404 if param == "model" else 400, param)
