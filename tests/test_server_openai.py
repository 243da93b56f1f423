"""The OpenAI-compatible HTTP API, spoken to by the official `openai` SDK and by raw httpx.

Every test shares one real server on the tiny Llama checkpoint (random weights, vocab 512). Greedy
requests with `ignore_eos` are deterministic, so the streamed and non-streamed forms of the same
request must agree exactly, and every completion runs to `max_tokens`.
"""

import asyncio
import itertools
import json
import time

import httpx
import openai
import pytest

from kvserve.engine import RequestDelta, SamplingParams
from kvserve.engine.async_engine import GenerationStream, RequestStream
from kvserve.engine.request import ProcessedRequest
from kvserve.server.generation import Generation

MODEL = "tiny-llama"
PROMPT = "The cache is"
OTHER_PROMPT = "A block table"
MESSAGES = [{"role": "user", "content": "Hello"}]
MAX_TOKENS = 16


def greedy(max_tokens: int = MAX_TOKENS, **extra_body) -> dict:
    """Arguments of a deterministic request that always runs to `max_tokens`."""
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": max_tokens,
        "extra_body": {"ignore_eos": True, **extra_body},
    }


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as sdk_client:
        yield sdk_client


@pytest.fixture(autouse=True)
def engine_is_idle_after_each_test(server):
    """Whatever a test did, streaming or not, every request ends and gives back all its KV blocks."""
    yield
    server.wait_until_idle()
    assert server.engine.kv_usage().num_used_blocks == 0


def tokenize(server, **body) -> list[int]:
    response = httpx.post(server.base_url + "/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def streamed_texts(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts


def finish_reasons(chunks) -> dict[int, list[str]]:
    reasons: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                reasons.setdefault(choice.index, []).append(choice.finish_reason)
    return reasons


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


# Completions and chat: streamed text equals non-streamed text, usage is right


def test_streamed_completion_text_equals_non_streamed_text_for_greedy(client, server):
    whole = client.completions.create(prompt=PROMPT, **greedy())
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **greedy()))

    assert whole.choices[0].text
    assert streamed_texts(chunks) == {0: whole.choices[0].text}
    assert whole.choices[0].finish_reason == "length"
    assert finish_reasons(chunks) == {0: ["length"]}
    num_prompt_tokens = len(tokenize(server, prompt=PROMPT))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (num_prompt_tokens, MAX_TOKENS)
    assert whole.usage.total_tokens == num_prompt_tokens + MAX_TOKENS


def test_async_streamed_completion_text_equals_non_streamed_text_for_greedy(server):
    async def both() -> tuple:
        async with async_client(server) as sdk_client:
            whole = await sdk_client.completions.create(prompt=PROMPT, **greedy())
            stream = await sdk_client.completions.create(prompt=PROMPT, stream=True, **greedy())
            return whole, [chunk async for chunk in stream]

    whole, chunks = asyncio.run(both())

    assert streamed_texts(chunks) == {0: whole.choices[0].text}
    assert whole.choices[0].finish_reason == "length"
    assert finish_reasons(chunks) == {0: ["length"]}
    assert whole.usage.completion_tokens == MAX_TOKENS


def test_streamed_chat_content_equals_non_streamed_content_for_greedy(client, server):
    whole = client.chat.completions.create(messages=MESSAGES, **greedy())
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **greedy()))

    content = whole.choices[0].message.content
    assert content
    assert whole.choices[0].message.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == content
    assert whole.choices[0].finish_reason == "length"
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices[0].finish_reason] == ["length"]
    num_prompt_tokens = len(tokenize(server, messages=MESSAGES))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (num_prompt_tokens, MAX_TOKENS)
    assert whole.usage.total_tokens == num_prompt_tokens + MAX_TOKENS


def test_async_streamed_chat_content_equals_non_streamed_content_for_greedy(server):
    async def both() -> tuple:
        async with async_client(server) as sdk_client:
            whole = await sdk_client.chat.completions.create(messages=MESSAGES, **greedy())
            stream = await sdk_client.chat.completions.create(messages=MESSAGES, stream=True, **greedy())
            return whole, [chunk async for chunk in stream]

    whole, chunks = asyncio.run(both())

    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "length"


def test_concurrent_async_requests_each_get_their_own_greedy_text(client, server):
    expected = {prompt: client.completions.create(prompt=prompt, **greedy()).choices[0].text
                for prompt in (PROMPT, OTHER_PROMPT)}  # fmt: skip

    async def all_at_once() -> list[str]:
        async with async_client(server) as sdk_client:
            requests = [
                sdk_client.completions.create(prompt=prompt, **greedy()) for prompt in [PROMPT, OTHER_PROMPT] * 3
            ]
            return [response.choices[0].text for response in await asyncio.gather(*requests)]

    assert asyncio.run(all_at_once()) == [expected[PROMPT], expected[OTHER_PROMPT]] * 3


def test_final_streamed_completion_chunk_carries_usage_and_no_choices(client, server):
    chunks = list(
        client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, n=2, **greedy())
    )

    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == []
    num_prompt_tokens = len(tokenize(server, prompt=PROMPT))
    # The prompt is counted once however many choices share it.
    assert usage_chunk.usage.prompt_tokens == num_prompt_tokens
    assert usage_chunk.usage.completion_tokens == 2 * MAX_TOKENS
    assert usage_chunk.usage.total_tokens == num_prompt_tokens + 2 * MAX_TOKENS
    assert all(chunk.choices and chunk.usage is None for chunk in content_chunks)


def test_final_streamed_chat_chunk_carries_usage_and_no_choices(client, server):
    chunks = list(
        client.chat.completions.create(
            messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **greedy()
        )
    )

    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    num_prompt_tokens = len(tokenize(server, messages=MESSAGES))
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (num_prompt_tokens, MAX_TOKENS)
    assert usage_chunk.usage.total_tokens == num_prompt_tokens + MAX_TOKENS


def test_streams_without_include_usage_send_no_usage(client):
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **greedy()))

    assert all(chunk.choices and chunk.usage is None for chunk in chunks)


# Prompt forms, n, seeds, response fields


def test_every_prompt_form_generates_the_same_text_for_the_same_tokens(client, server):
    text = client.completions.create(prompt=PROMPT, **greedy()).choices[0].text
    other_text = client.completions.create(prompt=OTHER_PROMPT, **greedy()).choices[0].text
    token_ids, other_token_ids = tokenize(server, prompt=PROMPT), tokenize(server, prompt=OTHER_PROMPT)

    from_token_ids = client.completions.create(prompt=token_ids, **greedy())
    from_strings = client.completions.create(prompt=[PROMPT, OTHER_PROMPT], **greedy())
    from_token_id_lists = client.completions.create(prompt=[token_ids, other_token_ids], **greedy())

    assert [c.text for c in from_token_ids.choices] == [text]
    assert from_token_ids.usage.prompt_tokens == len(token_ids)
    for response in (from_strings, from_token_id_lists):
        assert [(c.index, c.text) for c in response.choices] == [(0, text), (1, other_text)]
        assert response.usage.prompt_tokens == len(token_ids) + len(other_token_ids)
        assert response.usage.completion_tokens == 2 * MAX_TOKENS


def test_n_choices_have_indices_zero_to_n_minus_one(client):
    response = client.completions.create(prompt=PROMPT, n=3, seed=5, temperature=1.0, max_tokens=8, model=MODEL)
    chat = client.chat.completions.create(messages=MESSAGES, n=3, seed=5, temperature=1.0, max_tokens=8, model=MODEL)

    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert [choice.index for choice in chat.choices] == [0, 1, 2]


def test_n_greedy_choices_are_n_copies_of_the_greedy_text_each_counted_in_usage(client):
    # The defined behaviour: greedy decoding has one answer, so n > 1 returns it n times (not an error, not merged).
    single = client.completions.create(prompt=PROMPT, **greedy())
    response = client.completions.create(prompt=PROMPT, n=3, **greedy())
    chat = client.chat.completions.create(messages=MESSAGES, n=3, **greedy())
    chat_single = client.chat.completions.create(messages=MESSAGES, **greedy())

    assert [choice.text for choice in response.choices] == [single.choices[0].text] * 3
    assert [choice.message.content for choice in chat.choices] == [chat_single.choices[0].message.content] * 3
    assert response.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert response.usage.completion_tokens == chat.usage.completion_tokens == 3 * MAX_TOKENS


def test_choices_of_several_prompts_are_indexed_prompt_index_times_n_plus_i(client):
    texts = [client.completions.create(prompt=p, **greedy()).choices[0].text for p in (PROMPT, OTHER_PROMPT)]

    response = client.completions.create(prompt=[PROMPT, OTHER_PROMPT], n=2, **greedy())
    chunks = list(client.completions.create(prompt=[PROMPT, OTHER_PROMPT], n=2, stream=True, **greedy()))

    expected = {0: texts[0], 1: texts[0], 2: texts[1], 3: texts[1]}
    assert {choice.index: choice.text for choice in response.choices} == expected
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert streamed_texts(chunks) == expected


def test_seeded_choices_are_reproducible_and_differ_from_each_other(client):
    def sample(**kwargs) -> dict[int, str]:
        return {c.index: c.text for c in client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices}

    request = {"model": MODEL, "prompt": PROMPT, "n": 3, "seed": 1234, "temperature": 1.0, "max_tokens": 12}
    first, second = sample(**request), sample(**request)
    streamed = streamed_texts(client.completions.create(**request, stream=True, extra_body={"ignore_eos": True}))

    assert first == second == streamed
    assert len(set(first.values())) > 1
    assert sample(**{**request, "seed": 4321}) != first


def test_seeded_chat_choices_are_reproducible(client):
    request = {"model": MODEL, "messages": MESSAGES, "n": 2, "seed": 99, "temperature": 1.0, "max_tokens": 12}

    first = [c.message.content for c in client.chat.completions.create(**request).choices]
    second = [c.message.content for c in client.chat.completions.create(**request).choices]

    assert first == second


def test_responses_carry_id_created_model_and_object(client):
    before_s = int(time.time())
    completion = client.completions.create(prompt=PROMPT, **greedy(max_tokens=2))
    chat = client.chat.completions.create(messages=MESSAGES, **greedy(max_tokens=2))
    chat_chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **greedy(max_tokens=2)))
    after_s = int(time.time())

    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    assert completion.id != chat.id
    for response in (completion, chat, *chat_chunks):
        assert response.model == MODEL
        assert before_s <= response.created <= after_s
    assert {chunk.id for chunk in chat_chunks} == {chat_chunks[0].id}
    assert {chunk.object for chunk in chat_chunks} == {"chat.completion.chunk"}


# Logprobs and echo


def test_completion_logprobs_list_each_generated_token_with_its_alternatives(client):
    response = client.completions.create(prompt=PROMPT, logprobs=2, **greedy())

    logprobs = response.choices[0].logprobs
    num_tokens = response.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == num_tokens
    assert len(logprobs.text_offset) == num_tokens
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for logprob, alternatives in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert logprob <= 0
        assert 1 <= len(alternatives) <= 2  # two tokens with the same text share one key
        # Greedy picks the most likely token, so its logprob is the best alternative's.
        assert logprob == pytest.approx(max(alternatives.values()))


def test_streamed_completion_logprobs_cover_every_token_once(client):
    whole = client.completions.create(prompt=PROMPT, logprobs=2, **greedy())
    chunks = list(client.completions.create(prompt=PROMPT, logprobs=2, stream=True, **greedy()))

    streamed_tokens = [token for chunk in chunks for token in chunk.choices[0].logprobs.tokens]
    streamed_logprobs = [lp for chunk in chunks for lp in chunk.choices[0].logprobs.token_logprobs]
    assert streamed_tokens == whole.choices[0].logprobs.tokens
    assert streamed_logprobs == pytest.approx(whole.choices[0].logprobs.token_logprobs)


def test_chat_logprobs_list_each_generated_token_with_top_alternatives(client):
    response = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, **greedy())

    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_streamed_chat_logprobs_cover_every_token_once(client):
    whole = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, **greedy())
    chunks = list(
        client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, stream=True, **greedy())
    )

    streamed = [
        entry.token for chunk in chunks if chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content
    ]
    assert streamed == [entry.token for entry in whole.choices[0].logprobs.content]


def test_tokens_whose_text_is_empty_still_stream_with_their_logprobs(client, server):
    """A special token decodes to no text (skip_special_tokens); its chunk is still sent, as vLLM does."""
    special_id = tokenize(server, prompt="<|im_start|>", add_special_tokens=False)[0]
    request = greedy(max_tokens=4, logit_bias={str(special_id): 100})
    whole = client.completions.create(prompt=PROMPT, logprobs=1, **request)
    chunks = list(client.completions.create(prompt=PROMPT, logprobs=1, stream=True, **request))

    assert whole.choices[0].text == "" and whole.choices[0].logprobs.tokens == ["<|im_start|>"] * 4
    # The engine releases each token in its step (tests/test_engine_requests.py); a reader slower than the engine
    # gets the ones that piled up merged into one chunk, so the chunk count is not fixed, only that none is empty.
    assert all(chunk.choices[0].text == "" and chunk.choices[0].logprobs.tokens for chunk in chunks)
    assert [token for chunk in chunks for token in chunk.choices[0].logprobs.tokens] == ["<|im_start|>"] * 4
    chat_chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, logprobs=True, **request))
    streamed = [entry.token for chunk in chat_chunks[1:] for entry in chunk.choices[0].logprobs.content]
    assert streamed == ["<|im_start|>"] * 4  # after the role's chunk


def test_echo_prepends_the_prompt_text(client):
    text = client.completions.create(prompt=PROMPT, **greedy()).choices[0].text

    echoed = client.completions.create(prompt=PROMPT, echo=True, **greedy())
    streamed = streamed_texts(client.completions.create(prompt=PROMPT, echo=True, stream=True, **greedy()))

    assert echoed.choices[0].text == PROMPT + text
    assert streamed == {0: PROMPT + text}
    assert echoed.usage.completion_tokens == MAX_TOKENS


def test_echo_of_token_ids_shows_special_tokens_only_when_not_skipped(client, server):
    token_ids = tokenize(server, prompt=PROMPT)  # starts with BOS
    text = client.completions.create(prompt=PROMPT, **greedy()).choices[0].text

    skipped = client.completions.create(prompt=token_ids, echo=True, **greedy())
    kept = client.completions.create(prompt=token_ids, echo=True, **greedy(skip_special_tokens=False))

    assert skipped.choices[0].text == PROMPT + text
    assert kept.choices[0].text == "<|bos|>" + PROMPT + text


# Stop strings


def stop_across_token_boundary(chunk_texts: list[str]) -> str:
    """Two characters either side of a boundary between streamed chunks (so between tokens), where
    that string first occurs in the text."""
    text = "".join(chunk_texts)
    boundary = 0
    for before, after in itertools.pairwise(chunk_texts):
        boundary += len(before)
        stop = before[-2:] + after[:2]
        if len(before) >= 2 and len(after) >= 2 and stop.isprintable() and text.find(stop) == boundary - 2 > 0:
            return stop
    raise AssertionError(f"no clean token boundary in {chunk_texts!r}")


def test_stop_string_across_tokens_cuts_completion_and_is_never_streamed(client):
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **greedy(max_tokens=24)))
    chunk_texts = [chunk.choices[0].text for chunk in chunks if chunk.choices[0].text]
    text = "".join(chunk_texts)
    stop = stop_across_token_boundary(chunk_texts)
    expected = text[: text.index(stop)]

    whole = client.completions.create(prompt=PROMPT, stop=[stop, "zzz~never"], **greedy(max_tokens=24))
    stopped_chunks = list(
        client.completions.create(prompt=PROMPT, stop=[stop, "zzz~never"], stream=True, **greedy(max_tokens=24))
    )

    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "stop")
    assert whole.usage.completion_tokens < 24
    # What was streamed cannot be taken back: the stream must never run ahead of the cut.
    assert streamed_texts(stopped_chunks) == {0: expected}
    assert all(stop not in chunk.choices[0].text for chunk in stopped_chunks)
    assert finish_reasons(stopped_chunks) == {0: ["stop"]}


def test_stop_string_across_tokens_cuts_chat_content_and_is_never_streamed(client):
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **greedy(max_tokens=24)))
    chunk_texts = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices[0].delta.content]
    text = "".join(chunk_texts)
    stop = stop_across_token_boundary(chunk_texts)
    expected = text[: text.index(stop)]

    whole = client.chat.completions.create(messages=MESSAGES, stop=stop, **greedy(max_tokens=24))
    stopped_chunks = list(
        client.chat.completions.create(messages=MESSAGES, stop=stop, stream=True, **greedy(max_tokens=24))
    )

    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (expected, "stop")
    streamed = [chunk.choices[0].delta.content or "" for chunk in stopped_chunks]
    assert "".join(streamed) == expected
    assert all(stop not in piece for piece in streamed)
    assert stopped_chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_longer_than_200_characters_stops_generation(client):
    max_tokens = 160  # the tiny model's greedy text needs this many tokens to pass 200 characters
    text = client.completions.create(prompt=PROMPT, **greedy(max_tokens=max_tokens)).choices[0].text
    stop = text[3:210]
    assert len(stop) > 200
    expected = text[: text.index(stop)]

    whole = client.completions.create(prompt=PROMPT, stop=stop, **greedy(max_tokens=max_tokens))
    chunks = list(client.completions.create(prompt=PROMPT, stop=stop, stream=True, **greedy(max_tokens=max_tokens)))

    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "stop")
    assert whole.usage.completion_tokens < max_tokens
    assert streamed_texts(chunks) == {0: expected}
    assert finish_reasons(chunks) == {0: ["stop"]}


# vLLM extras in extra_body


def test_top_k_one_and_min_p_one_sample_the_greedy_text(client):
    greedy_text = client.completions.create(prompt=PROMPT, **greedy()).choices[0].text
    sampled = {"model": MODEL, "prompt": PROMPT, "temperature": 1.0, "max_tokens": MAX_TOKENS}

    top_k_text = client.completions.create(**sampled, seed=1, extra_body={"top_k": 1, "ignore_eos": True})
    min_p_text = client.completions.create(**sampled, seed=2, extra_body={"min_p": 1.0, "ignore_eos": True})

    assert top_k_text.choices[0].text == greedy_text
    assert min_p_text.choices[0].text == greedy_text


def test_repetition_penalty_changes_a_repetitive_greedy_text(client):
    plain = client.completions.create(prompt=PROMPT, logprobs=0, **greedy(max_tokens=24)).choices[0]
    assert len(set(plain.logprobs.tokens)) < len(plain.logprobs.tokens)  # greedy repeats itself

    penalised = client.completions.create(prompt=PROMPT, **greedy(max_tokens=24, repetition_penalty=2.0))

    assert penalised.choices[0].text != plain.text
    assert penalised.usage.completion_tokens == 24


def single_token_id(server, text: str) -> int | None:
    token_ids = tokenize(server, prompt=text, add_special_tokens=False)
    if len(token_ids) != 1:
        return None
    response = httpx.post(server.base_url + "/detokenize", json={"tokens": token_ids})
    return token_ids[0] if response.json()["prompt"] == text else None


def test_stop_token_id_finishes_early_but_not_before_min_tokens(client, server):
    tokens = client.completions.create(prompt=PROMPT, logprobs=0, **greedy(max_tokens=24)).choices[0].logprobs.tokens
    position, stop_id = next(
        (i, token_id)
        for i, token in enumerate(tokens[1:12], 1)
        if token.isascii() and (token_id := single_token_id(server, token)) is not None
    )
    first_position = tokens.index(tokens[position])

    stopped = client.completions.create(prompt=PROMPT, **greedy(max_tokens=24, stop_token_ids=[stop_id]))
    min_tokens = first_position + 5
    held = client.completions.create(
        prompt=PROMPT, **greedy(max_tokens=24, stop_token_ids=[stop_id], min_tokens=min_tokens)
    )

    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == first_position + 1
    assert held.usage.completion_tokens >= min_tokens


# Raw SSE framing


def sse_payloads(response: httpx.Response) -> list[str]:
    """The data of each event, checking that every event is exactly `data: <payload>\\n\\n`."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.text
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [event.removeprefix("data: ") for event in events]


def check_one_finish_per_choice_on_its_last_chunk(chunks: list[dict], num_choices: int) -> None:
    for index in range(num_choices):
        own = [choice for chunk in chunks for choice in chunk["choices"] if choice["index"] == index]
        finishing = [i for i, choice in enumerate(own) if choice["finish_reason"] is not None]
        assert finishing == [len(own) - 1], f"choice {index}: finish_reason on chunks {finishing} of {len(own)}"
        assert own[-1]["finish_reason"] == "length"


def test_raw_completion_stream_is_sse_data_events_ending_with_done(server):
    body = {"prompt": PROMPT, "stream": True, "n": 2, "stream_options": {"include_usage": True}, **greedy()}
    body.update(body.pop("extra_body"))

    payloads = sse_payloads(httpx.post(server.base_url + "/v1/completions", json=body, timeout=30))

    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    *content_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 2 * MAX_TOKENS
    check_one_finish_per_choice_on_its_last_chunk(content_chunks, num_choices=2)
    assert all(chunk["object"] == "text_completion" for chunk in chunks)


def test_raw_chat_stream_opens_each_choice_with_the_assistant_role(server):
    body = {"messages": MESSAGES, "stream": True, "n": 2, **greedy()}
    body.update(body.pop("extra_body"))

    payloads = sse_payloads(httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30))

    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    check_one_finish_per_choice_on_its_last_chunk(chunks, num_choices=2)
    for index in range(2):
        deltas = [choice["delta"] for chunk in chunks for choice in chunk["choices"] if choice["index"] == index]
        assert deltas[0]["role"] == "assistant"
        assert all("role" not in delta or delta["role"] is None for delta in deltas[1:])


def test_every_choice_of_a_wide_stream_finishes_exactly_once(client):
    n = 16
    request = {"prompt": PROMPT, "n": n, "seed": 3, "temperature": 1.0, "max_tokens": 24, "model": MODEL}

    chunks = list(client.completions.create(**request, stream=True, extra_body={"ignore_eos": True}))
    whole = client.completions.create(**request, extra_body={"ignore_eos": True})

    assert finish_reasons(chunks) == {index: ["length"] for index in range(n)}
    assert streamed_texts(chunks) == {choice.index: choice.text for choice in whole.choices}


# Models, tokenizer endpoints, health and docs


def test_models_lists_the_served_model_with_its_context_length(client):
    models = client.models.list().data

    assert [(model.id, model.object, model.owned_by) for model in models] == [(MODEL, "model", "kvserve")]
    assert models[0].model_extra["max_model_len"] == 512


def test_tokenize_and_detokenize_round_trip(server):
    token_ids = tokenize(server, prompt=PROMPT)
    bare_ids = tokenize(server, prompt=PROMPT, add_special_tokens=False)

    detokenized = httpx.post(server.base_url + "/detokenize", json={"model": MODEL, "tokens": bare_ids})

    assert token_ids[1:] == bare_ids  # the tokenizer prepends BOS
    assert detokenized.status_code == 200
    assert detokenized.json() == {"prompt": PROMPT}
    counted = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}).json()
    assert (counted["count"], counted["max_model_len"]) == (len(token_ids), 512)


def test_tokenize_messages_renders_the_chat_template(server):
    token_ids = tokenize(server, messages=MESSAGES)

    text = httpx.post(server.base_url + "/detokenize", json={"tokens": token_ids}).json()["prompt"]

    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_version_health_docs_and_openapi_are_served(server):
    version = httpx.get(server.base_url + "/version")
    health = httpx.get(server.base_url + "/health")
    docs = httpx.get(server.base_url + "/docs")
    schema = httpx.get(server.base_url + "/openapi.json")

    assert version.status_code == 200 and version.json()["version"]
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert schema.status_code == 200
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= set(schema.json()["paths"])


def test_each_choice_finishes_once_even_when_its_deltas_queue_up_behind_a_slow_reader():
    """While the reader is busy sending a chunk, one choice can get two deltas, the last one finished:
    the reader must see them in order, report that choice finished once, and still wait for the others."""

    class FakeEngine:
        def abort(self, request_ids) -> None:
            pass

    def delta(index: int, token_id: int, finish_reason: str | None) -> RequestDelta:
        return RequestDelta(f"cmpl-x-{index}", [token_id], "ab"[token_id - 5], None, finish_reason)

    async def settle() -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    async def read_all() -> list[tuple[int, str | None]]:
        streams = [RequestStream(), RequestStream()]
        processed = ProcessedRequest([[1]], [SamplingParams()], n=2)
        stream = GenerationStream(FakeEngine(), processed, ["cmpl-x-0", "cmpl-x-1"], streams)
        generation = Generation(stream, "cmpl-x", on_disconnect=lambda: None, model="tiny-llama")
        updates = generation.updates()
        streams[1].add(delta(1, 5, None))
        seen = [((choice := (await anext(updates))[0]).index, choice.finish_reason)]
        streams[0].add(delta(0, 5, None))
        await settle()
        streams[0].add(delta(0, 6, "length"))
        await settle()
        streams[1].add(delta(1, 6, "length"))
        seen += [(choice.index, choice.finish_reason) async for choice, _ in updates]
        assert [(choice.token_ids, choice.text) for choice in generation.choices] == [([5, 6], "ab"), ([5, 6], "ab")]
        return seen

    assert asyncio.run(read_all()) == [(1, None), (0, None), (0, "length"), (1, "length")]
