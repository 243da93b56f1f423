"""Tool calling through the chat API, with the openai SDK and langchain-openai against a live server: forced calls
(`required`, a named function) that always parse and fit their tool's schema, even from random weights; calls read
from the model's own output (`auto`, Hermes format); streamed calls that equal the whole answer; tool results sent
back in a conversation."""

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from kvserve.testing.tiny_checkpoint import IM_END, write_random_checkpoint
from tests.conftest import TINY_CONFIGS
from tests.server_harness import TINY_MODEL, assert_nothing_allocated, assert_openai_error, tiny_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = range(8)


@pytest.fixture(scope="module")
def long_context_llama(tiny_checkpoints, tokenizer, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama with room for tool definitions in its prompts (its vocabulary spells them out nearly
    character by character: two tools take some 500 tokens)."""
    config = TINY_CONFIGS["llama"](len(tokenizer))
    config.max_position_embeddings = 2048
    return {"llama": write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp("tools") / "llama", seed=7)}


@pytest.fixture(scope="module")
def live(long_context_llama):
    with tiny_server(long_context_llama, tool_call_parser="hermes") as running:
        yield running
        running.wait_until_idle()
        assert_nothing_allocated(running)


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0)


def ask(client, **fields):
    fields = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "temperature": 1.0, **fields}
    return client.chat.completions.create(model=TINY_MODEL, **fields)


def assert_valid_call(call) -> None:
    assert call.type == "function"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", SEEDS)
def test_required_forces_one_valid_call_to_one_of_the_tools(client, seed):
    choice = ask(client, tool_choice="required", parallel_tool_calls=False, seed=seed).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert_valid_call(call)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_named_function_is_the_one_called(client, seed):
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = ask(client, tool_choice=named, seed=seed).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert_valid_call(call)
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_are_the_whole_answer_in_fragments(client, tool_choice):
    whole = ask(client, tool_choice=tool_choice, parallel_tool_calls=False, seed=3).choices[0]
    chunks = list(ask(client, tool_choice=tool_choice, parallel_tool_calls=False, seed=3, stream=True))
    fragments = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert fragments[0].id is not None and fragments[0].function.name is not None
    assert all(fragment.id is None and fragment.function.name is None for fragment in fragments[1:])
    assert {fragment.index for fragment in fragments} == {0}
    (call,) = whole.message.tool_calls
    assert fragments[0].function.name == call.function.name
    assert "".join(fragment.function.arguments for fragment in fragments) == call.function.arguments
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"


def test_auto_reads_hermes_calls_out_of_the_models_text(client):
    # Random weights never write a call by themselves: a regex (vLLM's guided_regex extra) makes this one.
    text = 'Let me check. <tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    choice = ask(client, extra_body={"guided_regex": _literal_regex(text)}).choices[0]
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"tz": "CET"})
    assert choice.finish_reason == "tool_calls"


def test_auto_streams_the_content_then_the_call(client):
    text = 'Let me check. <tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    chunks = [chunk.choices[0] for chunk in ask(client, stream=True, extra_body={"guided_regex": _literal_regex(text)})
              if chunk.choices]  # fmt: skip
    content = "".join(choice.delta.content or "" for choice in chunks)
    fragments = [call for choice in chunks for call in choice.delta.tool_calls or []]
    assert content == "Let me check."
    assert (fragments[0].function.name, fragments[0].index) == ("get_time", 0)
    assert json.loads("".join(fragment.function.arguments for fragment in fragments)) == {"tz": "UTC"}
    assert chunks[-1].finish_reason == "tool_calls"


def test_auto_without_a_call_is_plain_content(client):
    choice = ask(client, max_tokens=8, seed=0).choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content


def test_none_keeps_the_tools_out_of_the_prompt_and_the_answer(client):
    with_tools = ask(client, tool_choice="none", max_tokens=4, seed=0)
    without = client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, max_tokens=4, seed=0)
    assert with_tools.usage.prompt_tokens == without.usage.prompt_tokens
    assert with_tools.choices[0].message.tool_calls is None


def test_a_conversation_with_a_call_and_its_result_reaches_the_template(live, client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    answer = ask(client, messages=messages, tool_choice="none", max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")
    tokens = httpx.post(live.base_url + "/tokenize", json={"messages": messages}).json()["tokens"]
    prompt = httpx.post(live.base_url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' + IM_END in prompt
    assert "<|im_start|>tool\nSunny, 21 C" + IM_END in prompt


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "not json"}}]}]}, "messages.0.tool_calls"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(live, fields, param):
    body = {"model": TINY_MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **fields}
    if body["tools"] is None:
        del body["tools"]
    assert_openai_error(httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=30), 400, param)


def test_auto_needs_a_server_with_a_tool_call_parser(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, max_tokens=4)
    assert error.value.body["param"] == "tool_choice"


def test_a_template_without_tool_support_refuses_tools(long_context_llama):
    plain = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    with tiny_server(long_context_llama, chat_template=plain, tool_call_parser="hermes") as running:
        client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as error:
            ask(client, tool_choice="required")
        assert error.value.body["param"] == "tools"


class Forecast(BaseModel):
    city: str = Field(max_length=6)
    days: int = Field(ge=1, le=7)


@tool(args_schema=Forecast)
def get_weather(city: str, days: int) -> str:
    """Forecast for a city."""
    return f"{city}: sunny for {days} days"


@pytest.fixture
def chat_model(live):
    return ChatOpenAI(model=TINY_MODEL, base_url=live.base_url + "/v1", api_key="unused", max_tokens=200, seed=5)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_parses_into_the_model(chat_model, method):
    for seed in range(4):
        structured = chat_model.bind(seed=seed).with_structured_output(Forecast, method=method)
        forecast = structured.invoke("Weather in Oslo for three days?")
        assert isinstance(forecast, Forecast)
        assert 1 <= forecast.days <= 7 and len(forecast.city) <= 6


def test_langchain_tool_round_trip(chat_model):
    caller = chat_model.bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("Weather in Lima?")
    ai_message = caller.invoke([question])
    (call,) = ai_message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "days"}
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    final = chat_model.bind(max_tokens=8).invoke([question, ai_message, result])
    assert isinstance(final.content, str) and final.content
    assert not final.tool_calls


def _literal_regex(text: str) -> str:
    """A regex (the grammar engine's syntax) matching exactly `text`."""
    return "".join("\\" + char if char in r"\.^$*+?()[]{}|/-" else char for char in text)
