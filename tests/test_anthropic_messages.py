"""POST /v1/messages and /v1/messages/count_tokens with the official `anthropic` SDK against a live server: the same
tokens as the chat request a message stands for, stop sequences named, Anthropic's stream events in order (text and
tool input), a tool use round trip, errors in Anthropic's shape, `x-api-key`, and every field of the SDK's
`MessageCreateParams` served or refused by name."""

import json
import typing

import anthropic
import httpx
import jsonschema
import openai
import pytest
from anthropic.types import message_count_tokens_params, message_create_params

from kvserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from tests.server_harness import TINY_MODEL, assert_nothing_allocated, tiny_server
from tests.test_tool_calling import SCHEMAS, WEATHER, _literal_regex

SYSTEM = "You answer in one line."
USER = [{"role": "user", "content": "Tell me about the river."}]
WEATHER_TOOL = {"name": "get_weather", "description": "Forecast", "input_schema": WEATHER}
TIME_TOOL = {"name": "get_time", "input_schema": SCHEMAS["get_time"]}
API_KEY = "sk-test-anthropic"


@pytest.fixture(scope="module")
def live(tiny_checkpoints, tokenizer, tmp_path_factory):
    from tests.test_tool_calling import TINY_CONFIGS, write_random_checkpoint

    config = TINY_CONFIGS["llama"](len(tokenizer))
    config.max_position_embeddings = 2048  # room for tool definitions, spelt out nearly character by character
    model = write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp("messages") / "llama", seed=7)
    with tiny_server({"llama": model}, tool_call_parser="hermes", api_key=API_KEY) as running:
        yield running
        running.wait_until_idle()
        assert_nothing_allocated(running)


@pytest.fixture
def client(live) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.base_url, api_key=API_KEY, max_retries=0)


def chat_text(live, messages, **fields) -> str:
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key=API_KEY, max_retries=0)
    fields = {"temperature": 0.0, "max_tokens": 12, **fields}
    return client.chat.completions.create(model=TINY_MODEL, messages=messages, **fields).choices[0].message.content


def create(client, temperature: float = 0.0, seed: int | None = None, **fields):
    """This SDK's `create` has no sampling arguments (the API still takes them): they go in the body."""
    extra_body = {
        "temperature": temperature,
        **({"seed": seed} if seed is not None else {}),
        **fields.pop("extra_body", {}),
    }
    fields = {"model": TINY_MODEL, "max_tokens": 12, "messages": USER, **fields}
    return client.messages.create(extra_body=extra_body, **fields)


def test_a_message_is_the_chat_completion_of_its_system_and_turns(client, live):
    message = create(client, system=SYSTEM)
    assert message.content[0].text == chat_text(live, [{"role": "system", "content": SYSTEM}, *USER])
    assert (message.type, message.role, message.model, message.stop_reason) == (
        "message", "assistant", TINY_MODEL, "max_tokens",
    )  # fmt: skip
    assert message.usage.output_tokens == 12 and message.usage.input_tokens > 0
    blocks = [{"type": "text", "text": "You answer "}, {"type": "text", "text": "in one line."}]
    assert create(client, system=blocks).content[0].text == message.content[0].text


def test_usage_splits_the_prompt_into_computed_and_cache_read_tokens(client, live):
    turns = [{"role": "user", "content": "A prompt of its own, long enough to fill some cache blocks: " + "ab " * 30}]
    first = create(client, messages=turns)
    hits_before = live.metric("prefix_cache_hit_tokens_total")
    second = create(client, messages=turns)
    assert second.usage.cache_read_input_tokens == live.metric("prefix_cache_hit_tokens_total") - hits_before > 0
    streamed = list(create(client, messages=turns, stream=True))
    prompt = client.messages.count_tokens(model=TINY_MODEL, messages=turns).input_tokens
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens == prompt
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == prompt
    start, end = streamed[0].message.usage, streamed[-2].usage
    assert (start.input_tokens, start.cache_read_input_tokens) == (
        second.usage.input_tokens,
        second.usage.cache_read_input_tokens,
    )
    assert (end.input_tokens, end.output_tokens) == (second.usage.input_tokens, 12)


def test_a_stop_sequence_ends_the_text_and_is_named(client):
    text = create(client, max_tokens=24).content[0].text
    stop = text[6:9]
    message = create(client, max_tokens=24, stop_sequences=["never appears", stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == text[: text.find(stop)]


def test_the_stream_sends_anthropics_events_in_order_and_adds_up_to_the_message(client):
    whole = create(client)
    events = list(create(client, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert "".join(event.delta.text for event in events[2:-3]) == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12
    with client.messages.stream(
        model=TINY_MODEL, max_tokens=12, messages=USER, extra_body={"temperature": 0.0}
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"


def test_a_tool_use_round_trip(client, live):
    first = create(client, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=80, temperature=1.0,
                   seed=2)  # fmt: skip
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "rain"},
                                     {"type": "text", "text": "Thanks!"}]},
    ]  # fmt: skip
    second = create(client, messages=turns, tools=[WEATHER_TOOL], tool_choice={"type": "none"})
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                                    "parameters": WEATHER}}]  # fmt: skip
    chat_messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}
        ]},
        {"role": "tool", "tool_call_id": call.id, "content": "rain"},
        {"role": "user", "content": "Thanks!"},
    ]  # fmt: skip
    assert second.content[0].text == chat_text(live, chat_messages, tools=chat_tools, tool_choice="none")
    count = client.messages.count_tokens(model=TINY_MODEL, messages=turns, tools=[WEATHER_TOOL],
                                         tool_choice={"type": "none"})  # fmt: skip
    assert count.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens


def test_a_named_tool_streams_its_input_as_json_deltas(client):
    fields = {"messages": [{"role": "user", "content": "Time?"}], "tools": [WEATHER_TOOL, TIME_TOOL],
              "tool_choice": {"type": "tool", "name": "get_time"}, "max_tokens": 80}  # fmt: skip
    whole = create(client, **fields)
    events = list(create(client, stream=True, **fields))
    starts = [event for event in events if event.type == "content_block_start"]
    assert [start.content_block.type for start in starts] == ["tool_use"]
    assert starts[0].content_block.name == "get_time"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == whole.content[0].input
    jsonschema.validate(whole.content[0].input, SCHEMAS["get_time"])
    assert events[-2].delta.stop_reason == whole.stop_reason == "tool_use"


def test_auto_returns_the_text_then_the_tool_use(client):
    text = 'Let me check. <tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    fields = {
        "tools": [TIME_TOOL],
        "max_tokens": 200,
        "extra_body": {"structured_outputs": {"regex": _literal_regex(text)}},
    }
    message = create(client, **fields)
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Let me check."
    assert (message.content[1].name, message.content[1].input) == ("get_time", {"tz": "CET"})
    with client.messages.stream(model=TINY_MODEL, messages=USER, **fields) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"tz": "CET"} and final.stop_reason == "tool_use"


def test_output_config_format_is_structured_output(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "ok": {"type": "boolean"}},
              "required": ["city", "ok"], "additionalProperties": False}  # fmt: skip
    message = create(client, max_tokens=60, output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)
    assert message.stop_reason == "end_turn"


def test_count_tokens_counts_what_create_would_prefill(client):
    count = client.messages.count_tokens(model=TINY_MODEL, system=SYSTEM, messages=USER)
    usage = create(client, system=SYSTEM).usage
    assert count.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    with_tools = client.messages.count_tokens(model=TINY_MODEL, messages=USER, tools=[WEATHER_TOOL])
    assert with_tools.input_tokens > count.input_tokens


def test_errors_take_anthropics_shape_and_name_the_field(client, live):
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(client, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])  # fmt: skip
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0.type" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        create(client, model="claude-nothing")
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": missing.value.body["error"]["message"]},
    }
    response = httpx.post(live.base_url + "/v1/messages", headers={"x-api-key": API_KEY},
                          json={"model": TINY_MODEL, "messages": USER}, timeout=30)  # fmt: skip
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert "max_tokens" in response.json()["error"]["message"]


def test_the_key_is_taken_from_x_api_key(live):
    wrong = anthropic.Anthropic(base_url=live.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        create(wrong)
    assert refused.value.body["error"]["type"] == "authentication_error"
    headers = {"authorization": f"Bearer {API_KEY}"}  # OpenAI's way works on these routes too
    body = {"model": TINY_MODEL, "max_tokens": 2, "messages": USER}
    assert httpx.post(live.base_url + "/v1/messages", headers=headers, json=body, timeout=30).status_code == 200


def sdk_fields(params: type) -> set[str]:
    return set(typing.get_type_hints(params))


def test_every_field_the_anthropic_sdk_sends_is_declared():
    assert sdk_fields(message_create_params.MessageCreateParamsBase) - set(MessagesRequest.model_fields) == set()
    assert (
        sdk_fields(message_count_tokens_params.MessageCountTokensParams) - set(CountTokensRequest.model_fields) == set()
    )


REFUSED = [
    ({"container": "container_1"}, "container"),
    ({"diagnostics": {"x": 1}}, "diagnostics"),
    ({"inference_geo": "us"}, "inference_geo"),
    ({"speed": "fast"}, "speed"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{**TIME_TOOL, "defer_loading": True}]}, "tools.0.defer_loading"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "s"}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image", "source": {}}]}]}]},
     "messages.0.content.0.content.0.type"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperatur": 0.5}, "temperatur"),
    ({"priority": 1}, "priority"),  # the server schedules first come, first served
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=[param for _, param in REFUSED])
def test_what_kvserve_does_not_serve_is_refused_by_name(live, fields, param):
    body = {"model": TINY_MODEL, "max_tokens": 4, "messages": USER, **fields}
    response = httpx.post(live.base_url + "/v1/messages", headers={"x-api-key": API_KEY}, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"], error


def test_fields_asking_for_what_kvserve_does_are_served(live):
    body = {"model": TINY_MODEL, "max_tokens": 2, "messages": USER, "metadata": {"user_id": "u"},
            "service_tier": "auto", "speed": "standard", "thinking": {"type": "disabled"},
            "cache_control": {"type": "ephemeral"}, "top_k": 5, "top_p": 0.9, "user_profile_id": "p",
            "workspace_id": "w", "tools": [{**TIME_TOOL, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "tool_choice": {"type": "none"}}  # fmt: skip
    response = httpx.post(live.base_url + "/v1/messages", headers={"x-api-key": API_KEY}, json=body, timeout=30)
    assert response.status_code == 200, response.text
