"""Requests through the engine on a tiny Llama: stop conditions, seeds, input validation and abort."""

import json
import math
import shutil
from dataclasses import replace

import pytest

from kvserve.engine import LLM, InvalidRequestError, RequestDelta, SamplingParams

PROMPT = "Once upon a time there was a small town"
MAX_MODEL_LEN = 512  # max_position_embeddings of the tiny configs
KV_CACHE_BYTES = 4 << 20  # 8192 tokens for the tiny models: room for every request here
LONG_PROMPT = [4 + i % 500 for i in range(600)]  # token ids, all in the vocabulary
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:
    return LLM(str(tiny_checkpoints["llama"]), kv_cache_memory_bytes=KV_CACHE_BYTES)


@pytest.fixture(scope="module")
def greedy_steps(llm) -> list[tuple[list[int], str]]:
    """(token ids, text) of a greedy run of PROMPT after each step: the tokens generated, the text released."""
    request_id = llm.engine.add_request(PROMPT, GREEDY)
    request = llm.engine.core.scheduler.get(request_id)
    steps, text = [], ""
    while llm.engine.has_unfinished():
        text += "".join(delta.text for delta in llm.engine.step() if delta.request_id == request_id)
        steps.append((list(request.output_token_ids), text))
    assert len(steps) == GREEDY.max_tokens
    return steps


def _step(engine, released: dict[str, list[RequestDelta]]) -> None:
    """One engine step, its deltas added to each request's list."""
    for delta in engine.step():
        released.setdefault(delta.request_id, []).append(delta)


def _run_to_end(engine, released: dict[str, list[RequestDelta]]) -> dict[str, RequestDelta]:
    """Step until nothing is left; every request's deltas merged into one."""
    while engine.has_unfinished():
        _step(engine, released)
    return {request_id: RequestDelta.merge(deltas) for request_id, deltas in released.items()}


def _assert_nothing_left(llm: LLM) -> None:
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv_usage().num_used_blocks == 0


def _first_token_not_seen_before(token_ids: list[int], start: int, excluded: frozenset[int]) -> int:
    return next(i for i in range(start, len(token_ids)) if token_ids[i] not in token_ids[:i] + list(excluded))


# Stop conditions


def test_a_stop_string_spanning_several_tokens_ends_the_text_just_before_it(llm, greedy_steps):
    token_ids, text = greedy_steps[-1]
    lengths = [len(step_text) for _, step_text in greedy_steps]
    # A stop string from the last character of one step's text, all of the next step's and the first of the one after.
    candidates = [
        (step, text[lengths[step - 1] - 1 : lengths[step] + 1])
        for step in range(2, len(lengths) - 1)
        if 0 < lengths[step - 1] < lengths[step] < lengths[step + 1]
    ]
    step, stop = next(
        (step, stop) for step, stop in candidates if "\ufffd" not in stop and text.find(stop) == lengths[step - 1] - 1
    )
    stop_at = lengths[step - 1] - 1
    completing_step = next(i for i, length in enumerate(lengths) if length > lengths[step])

    (output,) = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,)))

    assert output.finish_reason == "stop"
    assert output.text == text[:stop_at]
    assert stop not in output.text
    assert output.token_ids == token_ids[: completing_step + 1]
    _assert_nothing_left(llm)


def test_the_earliest_of_several_stop_strings_ends_the_text(llm, greedy_steps):
    _, text = greedy_steps[-1]
    clean = [i for i in range(len(text) - 4) if "\ufffd" not in text[i : i + 4]]
    early = text[next(i for i in clean if i >= 10) :][:3]
    early_at = text.find(early)
    late = next(text[i : i + 4] for i in clean if text.find(text[i : i + 4]) > early_at + 3)
    # Listed first, but found later in the text.
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(late, early))
    (output,) = llm.generate(PROMPT, params)
    assert output.finish_reason == "stop"
    assert output.text == text[:early_at]


def test_a_stop_string_that_never_appears_changes_nothing(llm, greedy_steps):
    token_ids, text = greedy_steps[-1]
    (output,) = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=("§§",)))
    assert (output.token_ids, output.text, output.finish_reason) == (token_ids, text, "length")


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_stop_token_id_ends_the_request_keeping_the_token_but_not_its_text(llm, greedy_steps, ignore_eos):
    token_ids, _ = greedy_steps[-1]
    stop_index = _first_token_not_seen_before(token_ids, 5, llm.engine.core.eos_token_ids)
    params = SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=ignore_eos, stop_token_ids=(token_ids[stop_index],)
    )
    (output,) = llm.generate(PROMPT, params)
    assert output.finish_reason == "stop"
    assert output.token_ids == token_ids[: stop_index + 1]
    assert output.text == greedy_steps[stop_index - 1][1]
    _assert_nothing_left(llm)


@pytest.fixture(scope="module")
def llm_with_eos(tmp_path_factory, tiny_checkpoints, greedy_steps):
    """The same model, with a token the greedy run produces declared as EOS in generation_config.json."""
    token_ids, _ = greedy_steps[-1]
    eos_index = _first_token_not_seen_before(token_ids, 7, frozenset({0, 1, 2, 3}))
    model_dir = tmp_path_factory.mktemp("eos") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], model_dir)
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    generation_config["eos_token_id"] = [token_ids[eos_index]]
    (model_dir / "generation_config.json").write_text(json.dumps(generation_config))
    llm = LLM(str(model_dir), kv_cache_memory_bytes=KV_CACHE_BYTES)
    assert token_ids[eos_index] in llm.engine.core.eos_token_ids
    assert not llm.engine.core.eos_token_ids & set(token_ids[:eos_index])  # no other EOS comes first
    return llm, eos_index


def test_eos_ends_the_request_keeping_the_token_but_not_its_text(llm_with_eos, greedy_steps):
    llm, eos_index = llm_with_eos
    token_ids, _ = greedy_steps[-1]
    (output,) = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0))
    assert output.finish_reason == "stop"
    assert output.token_ids == token_ids[: eos_index + 1]
    assert output.text == greedy_steps[eos_index - 1][1]
    _assert_nothing_left(llm)


def test_ignore_eos_generates_past_eos_up_to_max_tokens(llm_with_eos, greedy_steps):
    llm, _ = llm_with_eos
    token_ids, text = greedy_steps[-1]
    (output,) = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert (output.token_ids, output.text, output.finish_reason) == (token_ids, text, "length")


@pytest.mark.parametrize("max_tokens", [1, 2, 17])
def test_max_tokens_ends_the_request_with_length(llm, greedy_steps, max_tokens):
    (output,) = llm.generate(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    assert output.finish_reason == "length"
    assert output.token_ids == greedy_steps[-1][0][:max_tokens]
    assert output.text == greedy_steps[max_tokens - 1][1]


def test_a_request_may_fill_the_context_window_exactly(llm):
    prompt = LONG_PROMPT[: MAX_MODEL_LEN - 3]
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(output.token_ids) == 3
    assert output.finish_reason == "length"


# Release


def test_each_step_releases_a_token_whose_text_is_empty_when_nothing_is_held_back(llm):
    """A special token skipped in the text adds none, but nothing waits on it: its step releases it, so streams
    send it when it is made. Text that may begin a stop string is still held back with its tokens."""
    special = llm.engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias=((special, 100.0),), logprobs=0)
    released: dict[str, list[RequestDelta]] = {}
    request_id = llm.engine.add_request(PROMPT, forced)
    while llm.engine.has_unfinished():
        _step(llm.engine, released)
    deltas = released[request_id]
    assert [(delta.token_ids, delta.text) for delta in deltas] == [([special], "")] * 4
    assert all(len(delta.logprobs) == 1 for delta in deltas)

    # With a stop string that "x" may begin, the forced "x" tokens wait for text that settles it: the end.
    x = llm.engine.tokenizer.encode("x", add_special_tokens=False)[0]
    held = replace(forced, logit_bias=((x, 100.0),), stop=("xxxxxxxxy",), logprobs=None)
    released = {}
    request_id = llm.engine.add_request(PROMPT, held)
    while llm.engine.has_unfinished():
        _step(llm.engine, released)
    assert [(delta.token_ids, delta.text) for delta in released[request_id]] == [([x] * 4, "xxxx")]
    _assert_nothing_left(llm)


# Seeds

SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=1234, ignore_eos=True)


def test_seeded_sampling_reproduces_exactly_across_runs(llm):
    first, second = (llm.generate(PROMPT, SEEDED)[0] for _ in range(2))
    assert first.token_ids == second.token_ids
    assert first.text == second.text
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert first.token_ids != greedy.token_ids  # it really samples


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    (alone,) = llm.generate(PROMPT, SEEDED)
    companions = [
        ("The quick brown fox", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)),
        ("Children ran to school", SamplingParams(max_tokens=10, temperature=1.2, top_k=20, ignore_eos=True)),
        ("In the afternoon", SamplingParams(max_tokens=24, temperature=0.9, seed=99, ignore_eos=True)),
    ]
    prompts = [prompt for prompt, _ in companions]
    params = [p for _, p in companions]
    outputs = llm.generate([*prompts[:2], PROMPT, prompts[2]], [*params[:2], SEEDED, params[2]])
    assert outputs[2].token_ids == alone.token_ids

    # Companions that join while it decodes, and one that leaves early.
    engine, released = llm.engine, {}
    request_id = engine.add_request(PROMPT, SEEDED)
    for _ in range(5):
        _step(engine, released)
    leaver = engine.add_request("At night the town was quiet", SEEDED)
    for prompt, companion_params in companions:
        engine.add_request(prompt, companion_params)
    _step(engine, released)
    engine.abort(leaver)
    assert _run_to_end(engine, released)[request_id].token_ids == alone.token_ids


# Validation


def _bad(case_id: str, field: str, prompt: str | list[int] = PROMPT, **params):
    return pytest.param(prompt, SamplingParams(**params), field, id=case_id)


BAD_REQUESTS = [
    _bad("prompt longer than the context window", "prompt", LONG_PROMPT, max_tokens=1),
    _bad("prompt fills the context window", "prompt", LONG_PROMPT[:MAX_MODEL_LEN], max_tokens=1),
    _bad("prompt + max_tokens over the context window", "max_tokens", LONG_PROMPT[:500], max_tokens=13),
    _bad("max_tokens huge", "max_tokens", max_tokens=10**9),
    _bad("max_tokens 0", "max_tokens", max_tokens=0),
    _bad("max_tokens -1", "max_tokens", max_tokens=-1),
    _bad("max_tokens float", "max_tokens", max_tokens=2.0),
    _bad("temperature -1", "temperature", temperature=-1.0),
    _bad("temperature NaN", "temperature", temperature=math.nan),
    _bad("temperature inf", "temperature", temperature=math.inf),
    _bad("top_p 0", "top_p", top_p=0.0),
    _bad("top_p 1.5", "top_p", top_p=1.5),
    _bad("top_p NaN", "top_p", top_p=math.nan),
    _bad("top_k -2", "top_k", top_k=-2),
    _bad("min_p 1.5", "min_p", min_p=1.5),
    _bad("min_p -0.1", "min_p", min_p=-0.1),
    _bad("repetition_penalty 0", "repetition_penalty", repetition_penalty=0.0),
    _bad("repetition_penalty -1", "repetition_penalty", repetition_penalty=-1.0),
    _bad("repetition_penalty NaN", "repetition_penalty", repetition_penalty=math.nan),
    _bad("presence_penalty 2.5", "presence_penalty", presence_penalty=2.5),
    _bad("presence_penalty -2.5", "presence_penalty", presence_penalty=-2.5),
    _bad("frequency_penalty 2.5", "frequency_penalty", frequency_penalty=2.5),
    _bad("frequency_penalty -inf", "frequency_penalty", frequency_penalty=-math.inf),
    _bad("logprobs 21", "logprobs", logprobs=21),
    _bad("logprobs -1", "logprobs", logprobs=-1),
    _bad("seed 2**64", "seed", seed=2**64),
    _bad("empty stop string", "stop", stop=("",)),
    _bad("stop as one string", "stop", stop="END"),
    _bad("stop token id -1", "stop_token_ids", stop_token_ids=(-1,)),
    _bad("stop token id = vocab size", "stop_token_ids", stop_token_ids=(5, 512)),
    _bad("empty prompt string", "prompt", ""),
    _bad("empty prompt list", "prompt", []),
    _bad("prompt token id -1", "prompt", [5, -1, 6]),
    _bad("prompt token id = vocab size", "prompt", [5, 512]),
    _bad("prompt token id bool", "prompt", [5, True]),
]


@pytest.mark.parametrize(("prompt", "params", "field"), BAD_REQUESTS)
def test_a_bad_request_is_rejected_naming_the_field_and_leaves_nothing_behind(llm, prompt, params, field):
    with pytest.raises(InvalidRequestError) as caught:
        llm.engine.add_request(prompt, params)
    assert isinstance(caught.value, ValueError)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")
    _assert_nothing_left(llm)

    (output,) = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert output.finish_reason == "length" and len(output.token_ids) == 2
    _assert_nothing_left(llm)


def test_the_bounds_of_every_range_are_accepted(llm):
    params = SamplingParams(
        max_tokens=3,
        temperature=100.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        repetition_penalty=100.0,
        presence_penalty=2.0,
        frequency_penalty=-2.0,
        logprobs=20,
        seed=-(2**63),
        stop_token_ids=(0, 511),
        ignore_eos=True,
    )
    (output,) = llm.generate([0, 511], params)
    assert output.finish_reason == "length"
    assert [len(entry.top_logprobs) for entry in output.logprobs] == [20, 20, 20]


def test_a_batch_with_one_bad_request_is_rejected_whole(llm):
    with pytest.raises(InvalidRequestError, match="top_k"):
        llm.generate([PROMPT, "The quick brown fox", PROMPT], [GREEDY, GREEDY, SamplingParams(top_k=-5)])
    _assert_nothing_left(llm)


def test_a_request_id_in_use_is_rejected(llm):
    request_id = llm.engine.add_request(PROMPT, GREEDY, request_id="same")
    with pytest.raises(InvalidRequestError) as caught:
        llm.engine.add_request(PROMPT, GREEDY, request_id="same")
    assert caught.value.field == "request_id"
    llm.engine.abort(request_id)
    _assert_nothing_left(llm)


# Abort


def test_aborting_a_waiting_request_removes_it(llm):
    request_id = llm.engine.add_request(PROMPT, GREEDY)
    output = llm.engine.abort(request_id)
    assert output.finish_reason == "abort"
    assert output.token_ids == []
    _assert_nothing_left(llm)
    assert llm.engine.step() == []


def test_aborting_a_running_request_frees_its_blocks_at_once(llm, greedy_steps):
    engine, released = llm.engine, {}
    long_prompt = LONG_PROMPT[:70]  # 5 blocks of 16 tokens
    aborted = engine.add_request(long_prompt, GREEDY)
    kept = engine.add_request(PROMPT, GREEDY)
    for _ in range(3):
        _step(engine, released)
    blocks_of_kept = len(engine.core.scheduler.get(kept).block_ids)
    assert engine.kv_usage().num_used_blocks == len(engine.core.scheduler.get(aborted).block_ids) + blocks_of_kept

    last = engine.abort(aborted)

    assert last.finish_reason == "abort"
    assert len(RequestDelta.merge([*released.pop(aborted, []), last]).token_ids) == 3
    assert engine.kv_usage().num_used_blocks == blocks_of_kept
    outputs = _run_to_end(engine, released)
    assert set(outputs) == {kept}  # nothing more of the aborted request
    assert outputs[kept].token_ids == greedy_steps[-1][0]  # the other request is unaffected
    _assert_nothing_left(llm)


def test_aborting_the_only_running_request_frees_everything(llm):
    request_id, released = llm.engine.add_request(PROMPT, GREEDY), {}
    for _ in range(4):
        _step(llm.engine, released)
    assert llm.engine.kv_usage().num_used_blocks > 0
    output = RequestDelta.merge([*released.get(request_id, []), llm.engine.abort(request_id)])
    assert (output.finish_reason, len(output.token_ids)) == ("abort", 4)
    _assert_nothing_left(llm)


def test_aborting_a_finished_or_unknown_request_returns_none(llm):
    request_id = llm.engine.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.engine.abort(request_id) is None
    assert llm.engine.abort("no-such-request") is None
    _assert_nothing_left(llm)


def test_stop_strings_do_not_stop_before_min_tokens(llm, greedy_steps):
    token_ids, text = greedy_steps[-1]
    early_text = greedy_steps[2][1]  # the text after 3 tokens
    stop = early_text[-2:]
    assert len(stop) == 2 and text.find(stop) == len(early_text) - 2
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,))
    (stopped,) = llm.generate(PROMPT, params)
    assert len(stopped.token_ids) == 3

    (held,) = llm.generate(PROMPT, SamplingParams(**{**params.__dict__, "min_tokens": 10}))
    assert len(held.token_ids) >= 10
    assert held.token_ids == token_ids[: len(held.token_ids)]
    assert text.startswith(held.text)
    if held.finish_reason == "stop":  # a later occurrence, completed after min_tokens, may stop it
        assert text[len(held.text) :].startswith(stop) and len(held.text) > len(early_text)
