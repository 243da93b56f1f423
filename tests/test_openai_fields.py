"""Every field of OpenAI's completions and chat requests is served (with an effect asserted here or in the
feature's own tests) or refused with a 400 naming it; none is silently dropped."""

import logging
import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server_harness import TINY_MODEL, assert_openai_error, tiny_server

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Hello"}]
REFUSED_CHAT_VALUES = {
    "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "metadata": {"k": "v"},
    "moderation": {"model": "omni-moderation-latest"},
    "prediction": {"type": "content", "content": "Hi"},
    "prompt_cache_options": {"ttl": "1h"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "modalities": ["text", "audio"],
    "service_tier": "flex",
    "store": True,
}
SERVED_CHAT_VALUES = {"modalities": ["text"], "service_tier": "auto", "store": False, "user": "u-1",
                      "safety_identifier": "s-1", "prompt_cache_key": "k-1", "priority": 0}  # fmt: skip


def sdk_fields(params: type) -> set[str]:
    return set(typing.get_type_hints(params))


# What vllm-router 0.1.17 and sglang-router 0.3.2 forwarded to a worker for a plain request (captured from both):
# each re-serializes the body with SGLang's and vLLM's fields at their defaults.
ROUTER_ADDED_FIELDS = {"no_stop_trim": False, "return_hidden_states": False, "skip_special_tokens": True}
ROUTER_ADDED_CHAT_FIELDS = {**ROUTER_ADDED_FIELDS, "continue_final_message": False, "separate_reasoning": True,
                            "stream_reasoning": True, "include_reasoning": True, "logprobs": False}  # fmt: skip
ROUTER_FIELD_VALUES_REFUSED = [
    (COMPLETIONS, "no_stop_trim", True), (COMPLETIONS, "return_hidden_states", True), (CHAT, "no_stop_trim", True),
    (CHAT, "continue_final_message", True), (CHAT, "include_reasoning", False),
]  # fmt: skip


def test_what_the_routers_forward_is_served(server):
    completion = {"model": TINY_MODEL, "prompt": PROMPT, "max_tokens": 2, "echo": False, **ROUTER_ADDED_FIELDS}
    chat = {"model": TINY_MODEL, "messages": MESSAGES, "max_completion_tokens": 2, **ROUTER_ADDED_CHAT_FIELDS}
    # Not separating reasoning is what kvserve does anyway: it has no reasoning parser.
    unseparated = {**chat, "separate_reasoning": False, "stream_reasoning": False}
    for route, body in ((COMPLETIONS, completion), (CHAT, chat), (CHAT, unseparated)):
        response = httpx.post(server.base_url + route, json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("route", "field", "value"), ROUTER_FIELD_VALUES_REFUSED)
def test_a_router_field_asking_for_what_kvserve_does_not_do_is_a_400_naming_it(server, route, field, value):
    body = {"model": TINY_MODEL, "max_tokens": 2, field: value}
    body.update({"prompt": PROMPT} if route == COMPLETIONS else {"messages": MESSAGES})
    assert_openai_error(httpx.post(server.base_url + route, json=body, timeout=30), 400, field)


@pytest.mark.parametrize(
    ("sdk_params", "ours"),
    [(completion_create_params.CompletionCreateParamsBase, CompletionRequest),
     (chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest)],
    ids=["completions", "chat"],
)  # fmt: skip
def test_every_field_the_openai_sdk_sends_is_declared(sdk_params, ours):
    """A declared field is validated and acted on; an undeclared one would be refused as unknown."""
    assert sdk_fields(sdk_params) - set(ours.model_fields) - {"stream"} == set()


def test_the_refused_fields_are_the_sdks_fields():
    assert set(REFUSED_CHAT_VALUES) <= sdk_fields(chat_create_params.CompletionCreateParamsBase)


@pytest.mark.parametrize(("field", "value"), sorted(REFUSED_CHAT_VALUES.items()))
def test_a_chat_field_kvserve_does_not_serve_is_a_400_naming_it(server, field, value):
    body = {"model": TINY_MODEL, "messages": MESSAGES, "max_tokens": 2, field: value}
    assert_openai_error(httpx.post(server.base_url + CHAT, json=body, timeout=30), 400, field)


@pytest.mark.parametrize(("field", "value"), sorted(SERVED_CHAT_VALUES.items()))
def test_a_chat_field_with_a_value_kvserve_serves_is_accepted(server, field, value):
    body = {"model": TINY_MODEL, "messages": MESSAGES, "max_tokens": 2, field: value}
    assert httpx.post(server.base_url + CHAT, json=body, timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [(COMPLETIONS, {"suffix": "The end."}, "suffix"),
     (COMPLETIONS, {"best_of": 1, "n": 2}, "best_of"),
     (COMPLETIONS, {"best_of": 3, "stream": True}, "best_of"),
     (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
     (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options"),
     (COMPLETIONS, {"stream": True, "stream_options": {"include_obfuscation": True}},
      "stream_options.include_obfuscation"),
     (COMPLETIONS, {"logit_bias": {"not-a-token": 1}}, "logit_bias"),
     (COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias"),
     (COMPLETIONS, {"logit_bias": {"99999999": 1}}, "logit_bias"),
     (COMPLETIONS, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
     (CHAT, {"logit_bias": {"5": -100.5}}, "logit_bias"),
     # vLLM's priority: refused under the default fcfs policy (tests/test_priority_scheduling.py serves it).
     (COMPLETIONS, {"priority": 1}, "priority"),
     (CHAT, {"priority": -1}, "priority"),
     (COMPLETIONS, {"priority": "high"}, "priority")],
)  # fmt: skip
def test_out_of_range_or_unserved_values_are_400s_naming_the_field(server, route, fields, param):
    body = {"model": TINY_MODEL, "max_tokens": 2, **fields}
    body.update({"prompt": PROMPT} if route == COMPLETIONS else {"messages": MESSAGES})
    assert_openai_error(httpx.post(server.base_url + route, json=body, timeout=30), 400, param)


UNKNOWN_FIELDS = [
    (COMPLETIONS, {"max_token": 5}, "max_token"),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usages": True}}, "stream_options.include_usages"),
    (CHAT, {"frequency_penality": 0.5}, "frequency_penality"),
    (CHAT, {"messages": [{"role": "user", "content": "Hello", "nmae": "x"}]}, "messages.0.nmae"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}]}]},
     "messages.0.content.0.cache_control"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "strictly": True}}]}, "tools.0.function.strictly"),
    (CHAT, {"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "fields", "param"), UNKNOWN_FIELDS)
def test_a_field_nobody_declares_is_a_400_naming_it_as_openai_does(server, route, fields, param):
    body = {"model": TINY_MODEL, "max_tokens": 2}
    body.update({"prompt": PROMPT} if route == COMPLETIONS else {"messages": MESSAGES})
    error = assert_openai_error(httpx.post(server.base_url + route, json={**body, **fields}, timeout=30), 400, param)
    assert error["message"] == f"Unrecognized request argument supplied: {param}"


def test_every_unknown_field_is_named_and_tokenize_refuses_them_too(server):
    body = {"model": TINY_MODEL, "prompt": PROMPT, "max_token": 5, "temprature": 0}
    error = assert_openai_error(httpx.post(server.base_url + COMPLETIONS, json=body, timeout=30), 400, "max_token")
    assert error["message"] == "Unrecognized request arguments supplied: max_token, temprature"
    for route, fields in [("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [5]})]:
        response = httpx.post(server.base_url + route, json={**fields, "add_bos": True}, timeout=30)
        assert_openai_error(response, 400, "add_bos")


def test_with_accept_unknown_fields_they_are_logged_once_and_ignored(tiny_checkpoints, caplog):
    with tiny_server(tiny_checkpoints, accept_unknown_fields=True) as running, caplog.at_level(logging.WARNING):
        for _ in range(2):
            body = {"model": TINY_MODEL, "prompt": PROMPT, "max_tokens": 2, "vendor_extra": {"a": 1}}
            response = httpx.post(running.base_url + COMPLETIONS, json=body, timeout=30)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 2
    logged = [record.getMessage() for record in caplog.records if "vendor_extra" in record.getMessage()]
    assert logged == ["ignoring the unknown request field 'vendor_extra' (accept_unknown_fields is set)"]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_a_model_is_retrieved_by_its_id(client):
    assert client.models.retrieve(TINY_MODEL).id == TINY_MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")


def test_logit_bias_forces_a_token_in_completions_and_chat(server, client):
    token_id = 42
    token_text = server.engine.tokenizer.decode([token_id])
    forced = client.completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(token_id): 100})  # fmt: skip
    assert forced.choices[0].text == token_text * 4
    chat = client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, max_tokens=4, temperature=1.0,
                                          seed=3, logit_bias={str(token_id): 100})  # fmt: skip
    assert chat.choices[0].message.content == token_text * 4
    plain = client.completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert plain.choices[0].text != forced.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_then_the_answer(client):
    answer = client.completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                       logprobs=2)  # fmt: skip
    choice = answer.choices[0]
    num_prompt = answer.usage.prompt_tokens
    assert choice.text.startswith(PROMPT)
    assert len(choice.logprobs.tokens) == num_prompt + 3
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs[1:])
    scored_only = client.completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    assert scored_only.choices[0].text == PROMPT
    assert scored_only.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs[:num_prompt]
    assert scored_only.usage.completion_tokens == 0


def test_vllm_prompt_logprobs_equal_the_echoed_ones(server, client):
    echoed = client.completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    extra = client.completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=1,
                                      extra_body={"prompt_logprobs": 1})  # fmt: skip
    entries = extra.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None
    prompt_ids = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    scored = [entry[str(token_id)]["logprob"] for entry, token_id in zip(entries[1:], prompt_ids[1:], strict=True)]
    assert scored == pytest.approx(echoed.choices[0].logprobs.token_logprobs[1:], abs=1e-6)
    chat = client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})  # fmt: skip
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_best_of_returns_the_candidates_with_the_highest_summed_logprob(client):
    """Candidate i of a seeded request samples with seed + i, so each can be run alone and scored."""
    fields = {"model": TINY_MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 1.0}
    best = client.completions.create(**fields, best_of=4, n=2, seed=11, logprobs=0)
    candidates = [client.completions.create(**fields, seed=11 + i, logprobs=0).choices[0] for i in range(4)]
    candidates.sort(key=lambda choice: sum(choice.logprobs.token_logprobs), reverse=True)
    assert [choice.text for choice in best.choices] == [choice.text for choice in candidates[:2]]
    assert best.usage.completion_tokens == sum(len(choice.logprobs.tokens) for choice in candidates)
    without_logprobs = client.completions.create(**fields, best_of=4, n=2, seed=11)
    assert [choice.text for choice in without_logprobs.choices] == [choice.text for choice in best.choices]
    assert all(choice.logprobs is None for choice in without_logprobs.choices)


def test_cache_salt_keeps_cached_prefixes_apart(server, client):
    """vLLM's `cache_salt` extra: a salted request shares cached prefix blocks only with requests of its salt."""
    prompt = PROMPT * 20  # several full blocks

    def hits_of(salt: str) -> float:
        before = server.metric("prefix_cache_hit_tokens_total")
        client.completions.create(model=TINY_MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt})
        return server.metric("prefix_cache_hit_tokens_total") - before

    assert hits_of("salt-one") == 0
    assert hits_of("salt-two") == 0
    assert hits_of("salt-one") > 0
    empty = {"model": TINY_MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": ""}
    assert_openai_error(httpx.post(server.base_url + COMPLETIONS, json=empty, timeout=30), 400, "cache_salt")
