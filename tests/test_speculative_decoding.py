"""Speculative decoding with prompt-lookup (n-gram) drafts: the proposer, the acceptance rule, and greedy outputs
token for token those of decoding without drafts, on every scheduling path, with drafts really accepted."""

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from kvserve.engine import LLM, RequestDelta, SamplingParams
from kvserve.engine.speculative import (
    NgramProposer,
    SpeculationController,
    SpeculativeConfig,
    num_accepted_drafts,
)
from kvserve.kvcache import BlockAllocator
from kvserve.scheduler import FinishReason, Request, Scheduler, SchedulerConfig

# Not adaptive: every decoding request verifies what the proposer finds, whatever the steps' times on this machine.
NGRAM = SpeculativeConfig(
    method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, adaptive=False
)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def copy_heavy_prompts(num_prompts: int) -> list[list[int]]:
    """Prompts that repeat a passage, then begin it once more: the lookup finds what follows."""
    prompts = []
    for i in range(num_prompts):
        passage = [(7 * i + 3 * j) % 400 + 20 for j in range(12)]
        prompts.append(passage * 3 + passage[:3])
    return prompts


def test_the_proposer_continues_the_latest_earlier_occurrence_of_the_longest_ngram():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3))
    # "1 2 3" occurred twice; the latest occurrence is followed by 9, 9.
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 7, 1, 2, 3], 3) == [9, 9, 7]
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 7, 1, 2, 3], 1) == [9]
    # No 3-gram "8 2 3" earlier, so the 2-gram "2 3" decides.
    assert proposer.propose([2, 3, 6, 6, 8, 2, 3], 2) == [6, 6]
    # Past the end of what followed, the text goes on with the period of the occurrence: a loop runs on.
    assert proposer.propose([5, 5, 5, 5], 3) == [5, 5, 5]
    assert proposer.propose([7, 1, 2, 9, 1, 2, 9, 1, 2], 3) == [9, 1, 2]
    assert proposer.propose([7, 1, 2, 9, 1, 2, 9, 1, 2], 5) == [9, 1, 2, 9, 1]
    assert proposer.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert proposer.propose([1, 2], 3) == []  # too short to hold an earlier n-gram
    assert proposer.propose([1, 2, 1, 2], 0) == []


def reference_lookup(token_ids: list[int], max_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The proposer's rule written out plainly: the largest n whose last-n tokens occurred earlier (with a token
    after), its latest occurrence, and the text from there on repeated with that occurrence's period."""
    length = len(token_ids)
    for n in range(max_n, min_n - 1, -1):
        starts = [s for s in range(length - n) if token_ids[s : s + n] == token_ids[length - n :]]
        if starts and length > min_n and max_tokens > 0:
            period = length - n - starts[-1]
            text = list(token_ids)
            for _ in range(max_tokens):
                text.append(text[len(text) - period])
            return text[length:]
    return []


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_the_proposer_matches_the_rule_written_out_on_random_texts(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    proposer = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=min_n, prompt_lookup_max=max_n)
    )
    for _ in range(2000):
        vocab = rng.choice([2, 3, 5, 20])  # small vocabularies repeat n-grams often, at every size
        token_ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        max_tokens = rng.randint(0, 6)
        expected = reference_lookup(token_ids, max_tokens, min_n, max_n)
        assert proposer.propose(token_ids, max_tokens) == expected, (token_ids, max_tokens)


def test_greedy_acceptance_takes_drafts_while_each_equals_the_models_choice():
    assert num_accepted_drafts([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted_drafts([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted_drafts([4, 5, 6], [8, 5, 6, 7]) == 0
    assert num_accepted_drafts([], [8]) == 0


def test_a_request_gets_as_many_drafts_as_its_acceptance_earns():
    controller = SpeculationController(max_drafts=5)
    assert controller.num_drafts("r") == 5  # nothing measured yet
    for _ in range(12):
        controller.verified("r", 5, 0)  # its first draft always rejected
    assert controller.num_drafts("r") == 1  # one, to go on measuring
    for _ in range(20):
        controller.verified("r", 5, 5)
    assert controller.num_drafts("r") == 5
    for _ in range(40):
        controller.verified("s", 4, 1)  # one accepted, the next rejected: a chance of 1/2 a draft
    assert controller.num_drafts("s") == 3  # the third draft has a 1/8 chance of being used; a fourth, 1/16
    controller.forget("r")
    assert controller.num_drafts("r") == 5
    assert SpeculationController(max_drafts=5, adaptive=False).num_drafts("s") == 5


def test_speculation_runs_at_the_batch_sizes_where_measured_steps_gain():
    controller = SpeculationController(max_drafts=4)

    def decisions(num_decoding: int, rate_with: float, rate_without: float, num_steps: int = 320) -> list[bool]:
        made = []
        for _ in range(num_steps):
            made.append(controller.speculates(num_decoding))
            controller.stepped(num_decoding, made[-1], num_tokens=num_decoding, elapsed_s=num_decoding / (
                rate_with if made[-1] else rate_without))  # fmt: skip
        return made

    small = decisions(3, rate_with=300.0, rate_without=100.0)
    assert small[:8] == [True, False] * 4  # each way measured first, in turn
    # Then the losing way only to stay measured: after 32 steps, then 64, then 128 (it lost each time).
    assert [index for index, made in enumerate(small) if not made][4:] == [8 + 31, 8 + 31 + 64, 8 + 31 + 64 + 128]
    large = decisions(20, rate_with=80.0, rate_without=100.0)
    assert large.count(True) == 4 + 3
    # Batch sizes 3 and 4 share a decision (the same power of two); 20 and 32 too; 33 is measured afresh.
    assert controller.speculates(4) and not controller.speculates(32)
    assert controller.speculates(33)
    assert all(SpeculationController(4, adaptive=False).speculates(64) for _ in range(40))
    controller = SpeculationController(max_drafts=4)
    marginal = decisions(40, rate_with=103.0, rate_without=100.0)  # a gain under MIN_GAIN is no gain
    assert marginal.count(True) == 4 + 3
    # The text changes and drafts start to win: the next try of drafts turns the decision, and the way that now
    # loses is tried again after 32 steps.
    turned = decisions(40, rate_with=400.0, rate_without=100.0, num_steps=400)
    first_on = turned.index(True)
    assert first_on < 256 and all(turned[first_on + 2 : first_on + 30])
    assert not all(turned[first_on : first_on + 40])

    # A slow first step with drafts (new shapes to set up) does not decide alone: the mean of the first steps does.
    warming = SpeculationController(max_drafts=4)
    made = []
    for step in range(40):
        made.append(warming.speculates(1))
        rate = (10.0 if step == 0 else 300.0) if made[-1] else 100.0
        warming.stepped(1, made[-1], num_tokens=1, elapsed_s=1 / rate)
    assert made[8:].count(True) == 31  # one exploring step without


def test_with_a_draft_model_the_step_that_catches_the_draft_up_is_not_measured():
    """A step with drafts after one without first runs the tokens decoded since through the draft (slow here: 50
    tokens/s); steps with drafts in a row are fast (300 tokens/s, plain ones 100). Judged on its first steps, a draft
    model would lose for good (every try is a first step); the controller measures the second of a try."""

    def decisions(controller: SpeculationController, rate_in_a_row: float, num_steps: int = 300) -> list[bool]:
        made = []
        for _ in range(num_steps):
            drafting = controller.speculates(4)
            rate = (rate_in_a_row if made and made[-1] else 50.0) if drafting else 100.0
            made.append(drafting)
            controller.stepped(4, drafting, num_tokens=4, elapsed_s=4 / rate)
        return made

    made = decisions(SpeculationController(max_drafts=4, drafts_catch_up=True), rate_in_a_row=300.0)
    assert made[:12] == [True, True, False] * 4  # each way measured four times, a try of drafts being two steps
    # Then plain steps only to stay measured (the drafting step after each catches up, unmeasured).
    assert [index for index, drafting in enumerate(made) if not drafting][4:] == [
        12 + 31,
        12 + 31 + 64,
        12 + 31 + 64 + 128,
    ]
    assert not any(decisions(SpeculationController(max_drafts=4), rate_in_a_row=300.0)[8:39])  # judged on catch-ups
    losing = decisions(SpeculationController(max_drafts=4, drafts_catch_up=True), rate_in_a_row=80.0, num_steps=800)
    tried = [index for index, drafting in enumerate(losing) if drafting][8:]
    assert tried and tried[::2] == [index - 1 for index in tried[1::2]]  # tries of two steps in a row
    # A catch-up step takes two plain steps' time: for tries to cost at most 2% of the time, the first comes 100
    # steps after the measuring in turn (which ends at step 11), then 200 and 400 after each try's second step.
    assert tried[::2] == [11 + 100, 11 + 100 + 1 + 200, 11 + 100 + 1 + 200 + 1 + 400]


def test_a_draining_batch_does_not_switch_drafts_on():
    """A plain step takes 5 ms at any batch size from 17 to 32 (one power of two), a step with drafts 30 ms for four
    tokens a request: drafts lose at every size. As the batch drains, plain steps give fewer tokens a second; compared
    by tokens a second alone, the plain rate would fall towards 17 / 5 ms, below what drafts measured at 32 (128 /
    30 ms), and turn drafts on."""
    controller = SpeculationController(max_drafts=4)

    def steps(sizes) -> list[bool]:
        made = []
        for num_decoding in sizes:
            made.append(controller.speculates(num_decoding))
            num_tokens = num_decoding * (4 if made[-1] else 1)
            controller.stepped(num_decoding, made[-1], num_tokens, elapsed_s=0.030 if made[-1] else 0.005)
        return made

    assert steps([32] * 600).count(True) == 4 + 4  # measured in turn, then tried after 32, 64, 128 and 256 steps
    assert not any(steps([*range(31, 16, -1), *[17] * 20, *[32] * 10]))  # the next try is due after 512 steps


def test_speculative_config_is_checked():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)


BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4  # a 16-token block of the tiny models: 2 layers, K and V, 2 heads of 16, fp32


@dataclass
class Run:
    """Each request's tokens, text and finish reason, in prompt order; the draft tokens verified and accepted; the
    deltas."""

    outputs: list[tuple[list[int], str, str | None]]
    num_drafts: int
    num_accepted: int
    deltas: dict[str, list[RequestDelta]]
    verified: list[bool]  # per request: whether it verified drafts in some step


def run(llm: LLM, prompts, params) -> Run:
    """The prompts through the engine step by step (as `LLM.generate` does), keeping what each step accepted."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    deltas, num_drafts, num_accepted, verified = {request_id: [] for request_id in ids}, 0, 0, set()
    while engine.has_unfinished():
        result = engine.core.step()
        num_drafts += sum(item.num_draft_tokens for item in result.scheduled.scheduled)
        num_accepted += result.num_accepted_draft_tokens
        verified |= {item.request.request_id for item in result.scheduled.scheduled if item.num_draft_tokens}
        for delta in engine.process(result):
            deltas[delta.request_id].append(delta)
    merged = [RequestDelta.merge(deltas[request_id]) for request_id in ids]
    outputs = [(d.token_ids, d.text, d.finish_reason) for d in merged]
    return Run(outputs, num_drafts, num_accepted, deltas, [request_id in verified for request_id in ids])


def self_repeating_prompts(model_dir, num_prompts: int) -> list[list[int]]:
    """A few tokens and the model's own greedy continuation of them (the tiny random models fall into loops): the
    lookup then proposes what the model is likely to sample again."""
    starts = [[(11 * i + j) % 400 + 20 for j in range(4)] for i in range(num_prompts)]
    greedy = run(LLM(str(model_dir), kv_cache_memory_bytes=4 << 20), starts, GREEDY)
    return [start + tokens for start, (tokens, _, _) in zip(starts, greedy.outputs, strict=True)]


def run_both(model_dir, prompts, params, **settings) -> tuple[Run, Run, LLM]:
    """Without drafts and with them; and the speculating engine."""
    plain = run(LLM(str(model_dir), **settings), prompts, params)
    llm = LLM(str(model_dir), speculative_config=NGRAM, **settings)
    return plain, run(llm, prompts, params), llm


def test_greedy_outputs_equal_decoding_without_drafts_on_every_family(tiny_model):
    prompts = copy_heavy_prompts(4)
    plain, speculated, _ = run_both(tiny_model, prompts, GREEDY, kv_cache_memory_bytes=4 << 20)
    assert speculated.outputs == plain.outputs
    assert speculated.num_accepted > 0  # the drafts were used, not all turned away


def test_adaptive_speculation_keeps_greedy_outputs(tiny_checkpoints):
    model, prompts = tiny_checkpoints["mistral"], copy_heavy_prompts(8)
    adaptive = SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3)
    expected = run(LLM(str(model), kv_cache_memory_bytes=4 << 20, max_num_seqs=4), prompts, GREEDY)
    llm = LLM(str(model), kv_cache_memory_bytes=4 << 20, max_num_seqs=4, speculative_config=adaptive)
    speculated = run(llm, prompts, GREEDY)
    assert speculated.outputs == expected.outputs
    assert speculated.num_accepted > 0  # the first steps of each batch size speculate, whatever comes after


@pytest.mark.parametrize(
    "settings",
    [
        # Chunked prefill: prompts over several steps beside decodes that verify drafts.
        {"max_num_batched_tokens": 24, "max_num_seqs": 4},
        # Preemption: too few blocks for every request, drafts only in free blocks.
        {"kv_cache_memory_bytes": 16 * BLOCK_BYTES, "max_num_seqs": 6, "preemption": True},
        # No prefix cache.
        {"enable_prefix_caching": False},
        # A small token budget caps the drafts a step runs.
        {"max_num_batched_tokens": 8, "max_num_seqs": 2},
    ],
    ids=["chunked-prefill", "preemption", "no-prefix-cache", "small-budget"],
)
def test_greedy_outputs_equal_decoding_without_drafts_on_every_scheduling_path(tiny_checkpoints, settings):
    settings = dict(settings)
    preempts = settings.pop("preemption", False)
    settings = {"kv_cache_memory_bytes": 4 << 20, **settings}
    prompts = copy_heavy_prompts(6)
    plain, speculated, llm = run_both(tiny_checkpoints["llama"], prompts, GREEDY, **settings)
    assert speculated.outputs == plain.outputs
    assert speculated.num_accepted > 0
    if preempts:
        assert llm.engine.core.scheduler.num_preemptions > 0  # else this case tests nothing of it


def test_no_drafts_in_a_step_while_prompt_tokens_wait_for_its_budget(tiny_checkpoints):
    # Eight requests through four seats with small steps: whenever a prompt is being prefilled, or a waiting request
    # has a free seat, the step's budget goes to prompt tokens, not drafts; drafts run in the other steps.
    llm = LLM(str(tiny_checkpoints["llama"]), speculative_config=NGRAM, kv_cache_memory_bytes=4 << 20, max_num_seqs=4,
              max_num_batched_tokens=24)  # fmt: skip
    engine = llm.engine
    for prompt in copy_heavy_prompts(8):
        engine.add_request(prompt, GREEDY)
    num_accepted = num_mixed_steps = 0
    while engine.has_unfinished():
        result = engine.core.step()
        items = result.scheduled.scheduled
        prefilling = any(
            item.num_new_tokens > 1 + item.num_draft_tokens or not item.samples_next_token for item in items
        )
        num_mixed_steps += prefilling
        assert not (prefilling and any(item.num_draft_tokens for item in items))
        num_accepted += result.num_accepted_draft_tokens
        engine.process(result)
    assert num_mixed_steps > 0 and num_accepted > 0


def test_a_step_that_verifies_no_drafts_is_measured_as_a_plain_one(tiny_checkpoints):
    """Prompt lookup finds nothing in a prompt of distinct tokens, so the steps the controller gives drafts verify
    none: they ran as plain steps and are measured as such (counted as steps with drafts, they made drafts look no
    better than plain steps while a request had no match yet, and turned speculation off at one request)."""
    llm = LLM(str(tiny_checkpoints["llama"]), speculative_config=NGRAM, max_num_seqs=1, kv_cache_memory_bytes=4 << 20)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    result = run(llm, [list(range(20, 60))], params)
    assert result.num_drafts == 0  # nothing proposed: the generated tokens did not repeat a pair either
    rates = llm.engine.core.speculation._rates[1]  # the batch size of one's measured steps
    assert (rates.with_drafts.num_steps, rates.without_drafts.num_steps) == (0, 2)  # the first token is the prompt's


def test_prefix_cache_holds_only_accepted_tokens(tiny_checkpoints):
    # A second round continues the first round's outputs, reusing their blocks: were any block keyed by tokens whose
    # KV came from a rejected draft, the reused prefix would be wrong, and so would the outputs.
    model, prompts = tiny_checkpoints["qwen3"], copy_heavy_prompts(3)
    llm = LLM(str(model), speculative_config=NGRAM, kv_cache_memory_bytes=4 << 20)
    first = run(llm, prompts, GREEDY)
    continued = [prompt + tokens for prompt, (tokens, _, _) in zip(prompts, first.outputs, strict=True)]
    hits_before = llm.engine.core.scheduler.prefix_cache_hit_tokens
    again = run(llm, continued, GREEDY)
    assert llm.engine.core.scheduler.prefix_cache_hit_tokens - hits_before >= 3 * 64  # most of each was cached
    assert again.outputs == run(LLM(str(model), kv_cache_memory_bytes=4 << 20), continued, GREEDY).outputs
    assert first.num_accepted > 0 and again.num_accepted > 0
    assert llm.engine.kv_usage().num_used_blocks == 0


def test_max_tokens_and_stop_tokens_land_mid_proposal(tiny_checkpoints):
    model, prompts = tiny_checkpoints["mistral"], copy_heavy_prompts(4)
    reference = run(LLM(str(model), kv_cache_memory_bytes=4 << 20), prompts, GREEDY)
    # Stop at a token each output produces late: the output ends there, as without drafts, whatever was accepted
    # after it in the same step.
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=(tokens[25],))
        for tokens, _, _ in reference.outputs
    ]
    plain, speculated, llm = run_both(model, prompts, params, kv_cache_memory_bytes=4 << 20)
    assert speculated.outputs == plain.outputs
    assert all(reason == "stop" for _, _, reason in speculated.outputs) and speculated.num_accepted > 0
    for length in (1, 2, 5, 13):  # max_tokens reached after any number of drafts
        short = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
        expected = run(LLM(str(model), kv_cache_memory_bytes=4 << 20), prompts, short).outputs
        assert run(llm, prompts, short).outputs == expected
    assert llm.engine.kv_usage().num_used_blocks == 0


def test_stop_strings_and_deltas_of_several_tokens(tiny_checkpoints):
    model, prompts = tiny_checkpoints["llama"], copy_heavy_prompts(3)
    reference = run(LLM(str(model), kv_cache_memory_bytes=4 << 20), prompts, GREEDY)
    text = reference.outputs[0][1]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(text[len(text) // 2 :][:3],))
    plain, speculated, _ = run_both(model, prompts, params, kv_cache_memory_bytes=4 << 20)
    assert speculated.outputs == plain.outputs
    assert speculated.outputs[0][2] == "stop"
    # A step that accepted drafts releases its tokens in one delta.
    assert max(len(delta.token_ids) for deltas in speculated.deltas.values() for delta in deltas) > 1


def test_the_offline_api_speculates(tiny_checkpoints):
    model, prompts = tiny_checkpoints["qwen2"], copy_heavy_prompts(2)
    expected = LLM(str(model), kv_cache_memory_bytes=4 << 20).generate(prompts, GREEDY)
    # vLLM's form of the setting: a dict of its keys.
    setting = {"method": "ngram", "prompt_lookup_min": 1, "adaptive": False}
    llm = LLM(str(model), speculative_config=setting, kv_cache_memory_bytes=4 << 20)
    assert llm.engine.config.speculative_config == SpeculativeConfig(prompt_lookup_min=1, adaptive=False)
    outputs = llm.generate(prompts, GREEDY)
    assert [(o.token_ids, o.text) for o in outputs] == [(o.token_ids, o.text) for o in expected]


def test_penalties_and_min_tokens_count_the_drafts_before_each_row(tiny_checkpoints):
    # A verifying request's row after k drafts samples as decoding would after those k tokens: penalties count them
    # and min_tokens counts them. Greedy outputs equal decoding without drafts, with drafts accepted; logprobs come
    # from each accepted token's row; a request that wants its prompt's logprobs gets them as without drafts.
    model, prompts = tiny_checkpoints["llama"], copy_heavy_prompts(5)
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.02, frequency_penalty=0.05,
                       ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, presence_penalty=0.3, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, min_tokens=20),
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, prompt_logprobs=1, ignore_eos=True),
    ]  # fmt: skip
    plain, speculated, _ = run_both(model, prompts, params, kv_cache_memory_bytes=4 << 20)
    assert speculated.outputs == plain.outputs
    assert speculated.verified == [True] * 5
    accepted = [sum(len(delta.token_ids) > 1 for delta in deltas) for deltas in speculated.deltas.values()]
    assert all(accepted), accepted  # each got several tokens from some step
    prompt_logprobs, expected_prompt_logprobs = (
        [delta.prompt_logprobs for delta in list(run.deltas.values())[4] if delta.prompt_logprobs] for run in
        (speculated, plain)
    )  # fmt: skip
    assert len(prompt_logprobs) == 1 and len(prompt_logprobs[0]) == len(prompts[4])
    for entry, reference in zip(prompt_logprobs[0][1:], expected_prompt_logprobs[0][1:], strict=True):
        assert entry.token_id == reference.token_id
        assert entry.logprob == pytest.approx(reference.logprob, abs=1e-4)
    logprobs, expected = (
        [entry for delta in list(run.deltas.values())[3] for entry in delta.logprobs] for run in (speculated, plain)
    )
    assert [entry.token_id for entry in logprobs] == [entry.token_id for entry in expected]
    for entry, reference in zip(logprobs, expected, strict=True):
        assert [token for token, _ in entry.top_logprobs] == [token for token, _ in reference.top_logprobs]
        assert entry.logprob == pytest.approx(reference.logprob, abs=1e-4)


def test_seeded_sampling_with_drafts_is_reproducible(tiny_checkpoints):
    model = tiny_checkpoints["llama"]
    prompts = self_repeating_prompts(model, 3)
    params = [SamplingParams(max_tokens=30, temperature=0.5, top_k=3, seed=seed, ignore_eos=True) for seed in (1, 2, 3)]
    first = run(LLM(str(model), speculative_config=NGRAM, kv_cache_memory_bytes=4 << 20), prompts, params)
    second = run(LLM(str(model), speculative_config=NGRAM, kv_cache_memory_bytes=4 << 20), prompts[::-1], params[::-1])
    assert first.outputs == second.outputs[::-1]  # the same in another batch order
    assert first.num_accepted > 0


def sampled_pairs_without_and_with_drafts(model_dir, speculative_config: SpeculativeConfig) -> tuple[float, int]:
    """1,200 draws of the second and third tokens (those verified against drafts) at temperature 1 over a support of
    4 (top_k), without drafts and with them: the p-value of a chi-square test of homogeneity over the (second,
    third) pairs seen, and the drafts accepted."""
    from scipy.stats import chi2_contingency

    [prompt] = self_repeating_prompts(model_dir, 1)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
    counts, accepted = [Counter(), Counter()], [0, 0]
    for index, config in enumerate((None, speculative_config)):
        llm = LLM(str(model_dir), speculative_config=config, max_num_seqs=200, max_num_batched_tokens=8192,
                  kv_cache_memory_bytes=16 << 20)  # fmt: skip
        # Waves of 200, each prefilled in one step: no prompt waits for the budget while drafts are verified.
        for _ in range(6):
            result = run(llm, [prompt] * 200, params)
            counts[index].update(tuple(tokens[1:3]) for tokens, _, _ in result.outputs)
            accepted[index] += result.num_accepted
    assert accepted[0] == 0  # no drafts without speculation
    cells = sorted(set(counts[0]) | set(counts[1]))
    table = [[pairs[cell] for cell in cells] for pairs in counts]
    return chi2_contingency(table).pvalue, accepted[1]


def test_sampled_outputs_follow_the_targets_distribution(tiny_checkpoints):
    # The chi-square test must not reject at the 0.1% level. The drafts come from the prompt, not from the model's
    # distribution.
    pvalue, num_accepted = sampled_pairs_without_and_with_drafts(tiny_checkpoints["llama"], NGRAM)
    assert num_accepted > 50  # drafts were verified, and accepted now and then
    assert pvalue > 0.001


def test_rejected_drafts_are_left_past_the_computed_tokens():
    allocator = BlockAllocator(16)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), allocator, block_size=4)
    request = Request("r", [1, 2, 3, 4, 5, 6])
    scheduler.add(request)
    scheduler.update(scheduler.schedule(), [7])  # the prompt: 6 tokens in 2 blocks, 7 sampled
    assert len(request.block_ids) == 2 and allocator.num_free_blocks == 14
    request.draft_token_ids = [8, 9, 10, 11, 12, 13]
    output = scheduler.schedule()
    [item] = output.scheduled
    assert (item.num_new_tokens, item.num_draft_tokens) == (7, 6)
    assert len(request.block_ids) == 4  # positions 6..12: two more blocks
    scheduler.update(output, [20], num_accepted_drafts=[1])  # 8 accepted, then the model's 20
    assert request.output_token_ids == [7, 8, 20]
    assert request.num_computed_tokens == 8  # 6 prompt tokens, 7 and 8; 20 is the next step's
    # The blocks stay the request's: its next tokens overwrite the rejected drafts' KV there.
    assert len(request.block_ids) == 4 and allocator.num_free_blocks == 12
    request.draft_token_ids = []
    [item] = scheduler.schedule().scheduled
    assert (item.num_new_tokens, item.start_position) == (1, 8)
    scheduler.finish(request, FinishReason.STOP)
    assert allocator.num_free_blocks == 16


def test_drafts_never_preempt_and_respect_the_token_budget():
    allocator = BlockAllocator(4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), allocator, block_size=4)
    request, other = Request("r", [1, 2, 3, 4, 5, 6]), Request("o", [1, 2, 3, 4, 5])
    scheduler.add(request)
    scheduler.add(other)
    scheduler.update(scheduler.schedule(), [7, 7])  # both prompts, two blocks each: none free
    assert allocator.num_free_blocks == 0
    request.draft_token_ids = [9, 10, 11]
    output = scheduler.schedule()
    by_id = {item.request.request_id: item for item in output.scheduled}
    # One slot left in its last block after its token: one draft there, and no other request preempted for more.
    assert (by_id["r"].num_new_tokens, by_id["r"].num_draft_tokens) == (2, 1)
    assert (by_id["o"].num_new_tokens, by_id["o"].num_draft_tokens) == (1, 0)
    assert not output.preempted

    budgeted = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=3), BlockAllocator(16), block_size=4)
    request = Request("b", [1, 2])
    budgeted.add(request)
    budgeted.update(budgeted.schedule(), [3])
    request.draft_token_ids = [4, 5, 6, 7]
    [item] = budgeted.schedule().scheduled
    assert (item.num_new_tokens, item.num_draft_tokens) == (3, 2)  # the budget's 3 tokens: its own and two drafts


def test_the_server_takes_the_setting_and_counts_drafts_in_its_metrics(tiny_checkpoints):
    import httpx
    import openai

    from kvserve.server.settings import SettingsError, load_settings
    from tests.server_harness import running_server, wait_for

    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": false}'
    settings = load_settings(None, {"speculative_config": flag}, environ={})
    assert settings.engine_config().speculative_config == SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False
    )
    yaml_env = {"KVSERVE_SPECULATIVE_CONFIG": "{method: ngram, prompt_lookup_max: 2}"}
    assert load_settings(None, {}, environ=yaml_env).speculative_config.prompt_lookup_max == 2
    with pytest.raises(SettingsError, match="speculative_config"):
        load_settings(None, {"speculative_config": '{"method": "eagle"}'}, environ={})
    with pytest.raises(SettingsError, match="speculative_config"):
        load_settings(None, {"speculative_config": '{"num_speculative_tokens": 4, "typo": 1}'}, environ={})

    with running_server(
        model=str(tiny_checkpoints["llama"]), speculative_config=settings.speculative_config,
        kv_cache_memory_bytes=4 << 20,
    ) as server:  # fmt: skip
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        prompt = copy_heavy_prompts(1)[0]
        expected = run(LLM(str(tiny_checkpoints["llama"]), kv_cache_memory_bytes=4 << 20), [prompt], GREEDY)
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                               extra_body={"ignore_eos": True})  # fmt: skip
        assert completion.choices[0].text == expected.outputs[0][1]
        assert completion.usage.completion_tokens == 40
        drafts = server.metric("spec_decode_num_drafts_total")
        draft_tokens = server.metric("spec_decode_num_draft_tokens_total")
        accepted = server.metric("spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= draft_tokens <= 3 * drafts
        assert server.metric("generation_tokens_total") == 40

        # The console's live figure: tokens a verifying step gave, as the counters say (once a snapshot newer than
        # the step is taken: a poll within a second of the last gets the last).
        def live_figure() -> float | None:
            return httpx.get(server.base_url + "/v1/engine/state").json()["live"]["spec_acceptance_length"]

        wait_for(lambda: live_figure() is not None)
        assert live_figure() == pytest.approx(1 + accepted / drafts)


def test_a_request_can_opt_out_offline(tiny_checkpoints):
    model, prompts = tiny_checkpoints["llama"], copy_heavy_prompts(3)
    params = [GREEDY, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, speculative_decoding=False),
              GREEDY]  # fmt: skip
    plain, speculated, _ = run_both(model, prompts, params, kv_cache_memory_bytes=4 << 20)
    assert speculated.outputs == plain.outputs
    assert speculated.verified == [True, False, True]


def test_every_api_takes_the_opt_out(tiny_checkpoints):
    """`speculative_decoding: false` on completions, chat, Responses and Messages: no drafts for that request; the
    same request without it verifies drafts (prompt lookup of single tokens finds some in any text)."""
    import httpx

    from tests.server_harness import running_server

    prompt = " ".join(["the cache is cut into blocks"] * 3)
    bodies = {
        "/v1/completions": {"prompt": prompt},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": prompt}]},
        "/v1/responses": {"input": prompt, "max_output_tokens": 16},
        "/v1/messages": {"messages": [{"role": "user", "content": prompt}]},
    }
    config = SpeculativeConfig(prompt_lookup_min=1, adaptive=False)
    with running_server(model=str(tiny_checkpoints["llama"]), speculative_config=config,
                        kv_cache_memory_bytes=4 << 20) as server:  # fmt: skip
        model = server.ctx.model_name
        for path, body in bodies.items():
            drafts = []
            for opt_out in (True, False):
                request = {"model": model, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **body}
                if path == "/v1/responses":
                    request.pop("max_tokens")
                if opt_out:
                    request["speculative_decoding"] = False
                before = server.metric("spec_decode_num_drafts_total")
                response = httpx.post(server.base_url + path, json=request, timeout=60)
                assert response.status_code == 200, response.text
                drafts.append(server.metric("spec_decode_num_drafts_total") - before)
            assert drafts[0] == 0 < drafts[1], path


def test_two_tensor_parallel_ranks_verify_drafts_as_one(tiny_checkpoints):
    # Rank 0 plans each verifying step (its draft rows among the logits) and the other rank runs the same plan.
    model, prompts = tiny_checkpoints["qwen2"], copy_heavy_prompts(3)
    expected = run(LLM(str(model), kv_cache_memory_bytes=4 << 20), prompts, GREEDY)
    with LLM(str(model), tensor_parallel_size=2, speculative_config=NGRAM, kv_cache_memory_bytes=4 << 20) as llm:
        speculated = run(llm, prompts, GREEDY)
    assert speculated.outputs == expected.outputs
    assert speculated.num_accepted > 0


def test_an_int8_kv_cache_verifies_drafts_as_it_decodes(tiny_checkpoints):
    model, prompts = tiny_checkpoints["llama"], copy_heavy_prompts(3)
    settings = {"kv_cache_memory_bytes": 4 << 20, "kv_cache_dtype": "int8"}
    plain, speculated, _ = run_both(model, prompts, GREEDY, **settings)
    assert speculated.outputs == plain.outputs
    assert speculated.num_accepted > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_torch_path_and_the_triton_kernels_verify_drafts_too(tiny_checkpoints, backend):
    # Verifying steps through the prompt-chunk attention of the torch path and of the Triton kernels (in Triton's
    # interpreter here, as on CUDA), beside decodes, against the C++ kernels' run without drafts.
    model, prompts = tiny_checkpoints["llama"], copy_heavy_prompts(3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = run(LLM(str(model), kv_cache_memory_bytes=4 << 20), prompts, params)
    llm = LLM(str(model), attention_backend=backend, speculative_config=NGRAM, kv_cache_memory_bytes=4 << 20)
    speculated = run(llm, prompts, params)
    assert speculated.outputs == expected.outputs
    assert speculated.num_accepted > 0
