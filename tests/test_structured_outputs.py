"""Structured outputs: a constrained request's output matches its JSON schema, JSON object, regex, choice or EBNF
grammar, in the engine (batched, preempted, chunked, prefix-cached) and through the OpenAI API.

The tiny checkpoints have random weights, so the grammar alone has to make the output valid. A schema or grammar
that allows unbounded strings or arrays lets such a model ramble until `max_tokens`, so every constraint here
bounds everything it allows (enums, patterns of bounded length, `maxItems`, integer ranges) and every constrained
request must then stop on its own (finish reason "stop") well within MAX_TOKENS. Each output is checked by an
oracle independent of the grammar backend: Python's strict `json.loads` with `jsonschema`, or `re.fullmatch`.
"""

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from kvserve.engine import LLM, InvalidRequestError, RequestOutput, SamplingParams
from kvserve.engine.sampling_params import GrammarSpec
from tests.server_harness import assert_nothing_allocated, assert_openai_error, tiny_server

MODEL = "tiny-llama"
KV_CACHE_BYTES = 4 << 20  # 8192 tokens of the tiny models
BLOCK_BYTES = 8192  # one block of 16 tokens of the tiny Llama (2 layers, 2 KV heads of 16, fp32, K and V)
MAX_TOKENS = 200  # far more than any bounded output below needs
NUM_SEEDS = 16
PROMPTS = ["Once upon a time", "The cache is", "A block table", "Hello there, tell me about the town"]
MESSAGES = [{"role": "user", "content": "Describe the order as JSON."}]

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "by": {
            "type": "object",
            "properties": {
                "name": {"enum": ["ada", 'say "hi"', "zoë"]},
                "lvl": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["name", "lvl"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z][0-9]$"}, "n": {"enum": [1, 2, 3]}},
                "required": ["sku", "n"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "open": {"type": "boolean"},
    },
    "required": ["id", "by", "items", "open"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,5}-[0-9]{2}(\.[0-9])?"
CHOICES = ['say "hi"', "café", "naïve ünïcode ✓", "plain"]
# Up to three assignments: a grammar with rules, repetition ranges, alternatives and quoted strings.
EBNF = r"""
root ::= assignment ("; " assignment){0,2}
assignment ::= name " = " value
name ::= [a-z] [a-z0-9_]{0,5}
value ::= [0-9]{1,3} | "true" | "false" | "\"" [a-z]{0,4} "\""
"""
_ASSIGNMENT = r'[a-z][a-z0-9_]{0,5} = (?:[0-9]{1,3}|true|false|"[a-z]{0,4}")'
EBNF_AS_REGEX = rf"{_ASSIGNMENT}(?:; {_ASSIGNMENT}){{0,2}}"


def _json_schema(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def _check_schema(schema: dict):
    def check(text: str) -> None:
        jsonschema.validate(json.loads(text), schema)  # strict: a raw control character in a string is invalid

    return check


def _check_fullmatch(pattern: str):
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), text

    return check


def _check_choice(text: str) -> None:
    assert text in CHOICES


# Each kind of constraint with an oracle that does not use the grammar engine.
CONSTRAINTS = {
    "json_schema": (_json_schema(PERSON_SCHEMA), _check_schema(PERSON_SCHEMA)),
    "nested_json_schema": (_json_schema(ORDER_SCHEMA), _check_schema(ORDER_SCHEMA)),
    "regex": (GrammarSpec("regex", REGEX), _check_fullmatch(REGEX)),
    "choice": (GrammarSpec("choice", json.dumps(CHOICES)), _check_choice),
    "grammar": (GrammarSpec("grammar", EBNF), _check_fullmatch(EBNF_AS_REGEX)),
}


def _seeded(spec: GrammarSpec, num_seeds: int = NUM_SEEDS, max_tokens: int = MAX_TOKENS) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured_output=spec)
        for seed in range(num_seeds)
    ]


def _assert_all_valid(outputs: list[RequestOutput], check) -> None:
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        check(output.text)


def _assert_nothing_left(llm: LLM) -> None:
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv_usage().num_used_blocks == 0


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:
    return LLM(str(tiny_checkpoints["llama"]), kv_cache_memory_bytes=KV_CACHE_BYTES)


# The engine: every kind of constraint, sampled and greedy


def test_json_schema_outputs_validate_across_seeds_on_every_model(tiny_model):
    llm = LLM(str(tiny_model), kv_cache_memory_bytes=KV_CACHE_BYTES)
    spec, check = CONSTRAINTS["json_schema"]
    outputs = llm.generate([PROMPTS[0]] * 8, _seeded(spec, num_seeds=8))
    _assert_all_valid(outputs, check)
    assert len({output.text for output in outputs}) > 4  # sampled, not one answer forced
    _assert_nothing_left(llm)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_sampled_outputs_match_their_constraint(llm, kind):
    spec, check = CONSTRAINTS[kind]
    outputs = llm.generate(PROMPTS * (NUM_SEEDS // len(PROMPTS)), _seeded(spec))
    _assert_all_valid(outputs, check)
    _assert_nothing_left(llm)


def test_choice_outputs_cover_the_quoted_and_non_ascii_choices(llm):
    spec, _ = CONSTRAINTS["choice"]
    outputs = llm.generate([PROMPTS[1]] * 48, _seeded(spec, num_seeds=48))
    assert {output.text for output in outputs} == set(CHOICES)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_greedy_outputs_match_their_constraint_alone_and_batched(llm, kind):
    spec, check = CONSTRAINTS[kind]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=spec)
    batched = llm.generate(PROMPTS, params)
    _assert_all_valid(batched, check)
    alone = [llm.generate(prompt, params)[0] for prompt in PROMPTS[:2]]
    assert [output.token_ids for output in alone] == [output.token_ids for output in batched[:2]]


def test_json_object_outputs_that_stop_are_json_objects(llm):
    outputs = llm.generate([PROMPTS[0]] * 32, _seeded(GrammarSpec("json_object"), num_seeds=32, max_tokens=64))
    stopped = [output for output in outputs if output.finish_reason == "stop"]
    assert stopped  # a random model closes the object now and then; unbounded keys let the rest run on
    for output in stopped:
        assert isinstance(json.loads(output.text), dict), output.text
    for output in outputs:
        assert output.text.startswith("{")
        assert output.finish_reason == "stop" or len(output.token_ids) == 64


def test_constrained_and_unconstrained_requests_share_a_batch(llm):
    """The masks land on the constrained rows only, each row's own: free greedy neighbours are unchanged."""
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free_alone = [llm.generate(prompt, free)[0].token_ids for prompt in PROMPTS]
    kinds = sorted(CONSTRAINTS)
    rows: list[tuple[str, SamplingParams, object]] = []  # (prompt, params, check; None for a free row)
    for i, prompt in enumerate(PROMPTS):
        # Interleaved, a different constraint on every constrained row.
        for kind in (kinds[i % len(kinds)], kinds[(i + 2) % len(kinds)]):
            spec, check = CONSTRAINTS[kind]
            rows.append((prompt, SamplingParams(max_tokens=MAX_TOKENS, seed=i, structured_output=spec), check))
        rows.append((prompt, free, None))

    outputs = llm.generate([prompt for prompt, _, _ in rows], [params for _, params, _ in rows])

    free_batched = [output.token_ids for output, (_, _, check) in zip(outputs, rows, strict=True) if check is None]
    assert free_batched == free_alone
    for output, (_, _, check) in zip(outputs, rows, strict=True):
        if check is not None:
            _assert_all_valid([output], check)
    _assert_nothing_left(llm)


def test_preempted_constrained_requests_still_match(tiny_checkpoints):
    # 10 blocks of 16 tokens cannot hold 16 growing requests: the newest are preempted and recomputed.
    llm = LLM(str(tiny_checkpoints["llama"]), kv_cache_memory_bytes=10 * BLOCK_BYTES)
    spec, check = CONSTRAINTS["nested_json_schema"]
    outputs = llm.generate(PROMPTS * 4, _seeded(spec, max_tokens=140))
    assert llm.engine.core.scheduler.num_preemptions > 0
    _assert_all_valid(outputs, check)
    _assert_nothing_left(llm)


def test_constrained_requests_match_with_prefix_caching_and_chunked_prefill(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), kv_cache_memory_bytes=KV_CACHE_BYTES, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_prefill_chunk_tokens=8)  # fmt: skip
    shared = " ".join(PROMPTS * 4)  # several full blocks, prefilled 8 tokens a step
    prompts = [f"{shared} {suffix}" for suffix in PROMPTS]
    spec, check = CONSTRAINTS["nested_json_schema"]
    _assert_all_valid(llm.generate(prompts[:1], _seeded(spec, num_seeds=1)), check)
    outputs = llm.generate(prompts * 3, _seeded(spec, num_seeds=12))
    assert llm.engine.core.scheduler.prefix_cache_hit_tokens > 0
    _assert_all_valid(outputs, check)
    _assert_nothing_left(llm)


def test_a_stop_string_ends_a_constrained_output_before_it(llm):
    spec, _ = CONSTRAINTS["json_schema"]
    whole = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=spec))
    stop = ", "  # between the first two properties
    stopped = llm.generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=spec, stop=(stop,))
    )
    for full, output in zip(whole, stopped, strict=True):
        assert output.finish_reason == "stop"
        assert output.text == full.text[: full.text.index(stop)]
        assert output.text.startswith('{"name": "')
    _assert_nothing_left(llm)


@pytest.mark.parametrize("field", ["min_tokens", "ignore_eos"])
def test_a_constraint_cannot_be_combined_with_forced_length(llm, field):
    # Once the grammar is complete only a stop token may follow: a request that may not stop would be stuck.
    overrides = {"min_tokens": 2} if field == "min_tokens" else {"ignore_eos": True}
    params = SamplingParams(max_tokens=8, structured_output=GrammarSpec("regex", REGEX), **overrides)
    with pytest.raises(InvalidRequestError) as error:
        llm.engine.add_request(PROMPTS[0], params)
    assert error.value.field == field
    _assert_nothing_left(llm)


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("json_schema", json.dumps({"type": "nonsense"})),
        GrammarSpec("regex", "((("),
        GrammarSpec("grammar", "root ::= undefined_rule"),
    ],
    ids=["json_schema", "regex", "grammar"],
)
def test_a_constraint_that_does_not_compile_is_refused_and_nothing_is_queued(llm, spec):
    with pytest.raises(InvalidRequestError) as error:
        llm.engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, structured_output=spec))
    assert error.value.field == "structured_output"
    _assert_nothing_left(llm)


@pytest.mark.parametrize(
    "string_schema",
    [
        {"type": "string", "maxLength": 12},
        {"type": "string", "minLength": 2, "maxLength": 12},
        {"type": "string", "pattern": "^.{0,12}$"},
        {"type": "string"},
    ],
    ids=["max_length", "min_and_max_length", "pattern", "unbounded"],
)
def test_a_json_string_never_holds_a_raw_control_character(llm, string_schema):
    """JSON forbids U+0000-U+001F unescaped in a string: pushed up by logit_bias, they still never get in."""
    tokenizer = llm.engine.tokenizer
    encodings = [tokenizer.encode(chr(code), add_special_tokens=False) for code in range(32)]
    control_token_ids = sorted({ids[0] for ids in encodings if len(ids) == 1})
    assert len(control_token_ids) == 32  # byte-level BPE: one token per byte
    schema = {"type": "object", "properties": {"s": string_schema}, "required": ["s"], "additionalProperties": False}
    params = SamplingParams(
        max_tokens=40, temperature=0.0, structured_output=_json_schema(schema),
        logit_bias=tuple((token_id, 100.0) for token_id in control_token_ids),
    )  # fmt: skip
    outputs = llm.generate(PROMPTS, params)
    for output in outputs:
        assert not any(ord(char) < 32 for char in output.text), ascii(output.text)
        if output.finish_reason == "stop":  # an unbounded string may run on to max_tokens
            _check_schema(schema)(output.text)
    bounded = "maxLength" in string_schema or "pattern" in string_schema
    assert not bounded or all(output.finish_reason == "stop" for output in outputs)


# The OpenAI API


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    with tiny_server(tiny_checkpoints) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as sdk_client:
        yield sdk_client


@pytest.fixture(autouse=True)
def no_block_held_after_a_server_test(request):
    """Every server test ends with every request finished and every KV block free."""
    yield
    if "server" in request.fixturenames:
        assert_nothing_allocated(request.getfixturevalue("server"))


def _chat_texts(client: openai.OpenAI, stream: bool, **kwargs) -> list[tuple[str, str]]:
    """(content, finish reason) of each choice, the streamed deltas joined."""
    if not stream:
        response = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        return [(choice.message.content, choice.finish_reason) for choice in response.choices]
    texts: dict[int, list] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kwargs):
        for choice in chunk.choices:
            entry = texts.setdefault(choice.index, ["", None])
            entry[0] += choice.delta.content or ""
            entry[1] = choice.finish_reason or entry[1]
    return [tuple(texts[index]) for index in sorted(texts)]


def _completion_texts(client: openai.OpenAI, stream: bool, **kwargs) -> list[tuple[str, str]]:
    if not stream:
        response = client.completions.create(model=MODEL, prompt=PROMPTS[0], **kwargs)
        return [(choice.text, choice.finish_reason) for choice in response.choices]
    texts: dict[int, list] = {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **kwargs):
        for choice in chunk.choices:
            entry = texts.setdefault(choice.index, ["", None])
            entry[0] += choice.text
            entry[1] = choice.finish_reason or entry[1]
    return [tuple(texts[index]) for index in sorted(texts)]


def _assert_choices_valid(choices: list[tuple[str, str]], check, n: int) -> None:
    assert len(choices) == n
    for text, finish_reason in choices:
        assert finish_reason == "stop", text
        check(text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema_gives_n_valid_objects(client, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA,
                                                              "strict": True}}  # fmt: skip
    choices = _chat_texts(client, stream, max_tokens=MAX_TOKENS, n=3, seed=5, response_format=response_format)
    _assert_choices_valid(choices, _check_schema(PERSON_SCHEMA), n=3)
    assert len({text for text, _ in choices}) > 1  # each choice samples its own


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_object_gives_json_objects(client, stream):
    choices = _chat_texts(client, stream, max_tokens=64, n=16, seed=3, response_format={"type": "json_object"})
    assert any(finish_reason == "stop" for _, finish_reason in choices)
    for text, finish_reason in choices:
        assert text.startswith("{")
        if finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text


EXTRA_BODIES = {
    "guided_regex": ({"guided_regex": REGEX}, _check_fullmatch(REGEX)),
    "guided_choice": ({"guided_choice": CHOICES}, _check_choice),
    "guided_json": ({"guided_json": ORDER_SCHEMA}, _check_schema(ORDER_SCHEMA)),
    "guided_grammar": ({"guided_grammar": EBNF}, _check_fullmatch(EBNF_AS_REGEX)),
    "structured_outputs.json": ({"structured_outputs": {"json": ORDER_SCHEMA}}, _check_schema(ORDER_SCHEMA)),
    "structured_outputs.regex": ({"structured_outputs": {"regex": REGEX}}, _check_fullmatch(REGEX)),
    "structured_outputs.choice": ({"structured_outputs": {"choice": CHOICES}}, _check_choice),
    "structured_outputs.grammar": ({"structured_outputs": {"grammar": EBNF}}, _check_fullmatch(EBNF_AS_REGEX)),
}


@pytest.mark.parametrize("name", sorted(EXTRA_BODIES))
def test_vllm_extras_constrain_whole_completions_and_streamed_chat(client, name):
    extra_body, check = EXTRA_BODIES[name]
    completions = _completion_texts(client, False, max_tokens=MAX_TOKENS, n=2, seed=11, extra_body=extra_body)
    _assert_choices_valid(completions, check, n=2)
    chats = _chat_texts(client, True, max_tokens=MAX_TOKENS, n=2, seed=11, extra_body=extra_body)
    _assert_choices_valid(chats, check, n=2)


def test_streamed_completions_and_whole_chat_are_constrained_too(client):
    extra_body, check = EXTRA_BODIES["guided_grammar"]
    _assert_choices_valid(_completion_texts(client, True, max_tokens=MAX_TOKENS, n=3, extra_body=extra_body), check, 3)
    _assert_choices_valid(_chat_texts(client, False, max_tokens=MAX_TOKENS, n=3, extra_body=extra_body), check, 3)


def test_nested_schema_outputs_validate_for_many_seeds_streamed_and_not(server):
    """24 seeds, all in flight at once, each asked for whole and streamed: the same seed gives the same object."""
    response_format = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA,
                                                              "strict": True}}  # fmt: skip
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "response_format": response_format}

    async def whole(sdk_client, seed: int) -> tuple[str, str]:
        response = await sdk_client.chat.completions.create(seed=seed, **kwargs)
        return response.choices[0].message.content, response.choices[0].finish_reason

    async def streamed(sdk_client, seed: int) -> tuple[str, str]:
        text, finish_reason = "", None
        async for chunk in await sdk_client.chat.completions.create(seed=seed, stream=True, **kwargs):
            text += chunk.choices[0].delta.content or ""
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        return text, finish_reason

    async def run_all() -> tuple[list, list]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as sdk_client:
            seeds = range(24)
            wholes = await asyncio.gather(*(whole(sdk_client, seed) for seed in seeds))
            streams = await asyncio.gather(*(streamed(sdk_client, seed) for seed in seeds))
            return wholes, streams

    wholes, streams = asyncio.run(run_all())

    _assert_choices_valid(wholes, _check_schema(ORDER_SCHEMA), n=24)
    _assert_choices_valid(streams, _check_schema(ORDER_SCHEMA), n=24)
    assert streams == wholes


COMPLETION = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8}
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
BAD_REQUESTS = {
    "invalid_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        "response_format.json_schema.schema",
    ),
    "invalid_guided_json": ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    "invalid_regex": ({"guided_regex": "((("}, "guided_regex"),
    "invalid_grammar": ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    "empty_choice": ({"guided_choice": []}, "guided_choice"),
    "two_constraints": ({"guided_regex": REGEX, "guided_choice": CHOICES}, "guided_choice"),
    "two_in_structured_outputs": ({"structured_outputs": {"regex": REGEX, "choice": CHOICES}}, "structured_outputs"),
    "min_tokens": ({"guided_regex": REGEX, "min_tokens": 2}, "min_tokens"),
    "ignore_eos": ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
}


@pytest.mark.parametrize("path, valid", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
                         ids=["completions", "chat"])  # fmt: skip
@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_a_bad_constraint_is_a_400_naming_its_field_and_the_server_serves_on(server, path, valid, case):
    body, param = BAD_REQUESTS[case]
    response = httpx.post(server.base_url + path, json={**valid, **body}, timeout=30)
    assert_openai_error(response, 400, param)
    assert_nothing_allocated(server)
    ok = httpx.post(server.base_url + path, json={**valid, "guided_regex": REGEX, "max_tokens": MAX_TOKENS}, timeout=30)
    assert ok.status_code == 200, ok.text
    choice = ok.json()["choices"][0]
    assert re.fullmatch(REGEX, choice["text"] if "text" in choice else choice["message"]["content"])
