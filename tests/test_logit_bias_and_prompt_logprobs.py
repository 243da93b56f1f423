"""logit_bias (added to the logits before sampling) and prompt logprobs (the prompt's tokens scored while it
is prefilled), on the engine; their HTTP shapes are in tests/test_openai_fields.py."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve.engine import LLM, InvalidRequestError, SamplingParams
from kvserve.engine.sampler import LogitBias, SamplingRow, sample

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_sampler_adds_each_rows_bias_to_its_logits_only():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    biased = [(7, 100.0), (int(logits[1].argmax()), -100.0)]
    rows = [
        SamplingRow(GREEDY),
        SamplingRow(GREEDY, logit_bias=LogitBias.of(tuple(biased), logits.device)),
        SamplingRow(GREEDY),
    ]
    expected = logits.clone()
    for token_id, bias in biased:
        expected[1, token_id] += bias
    tokens = sample(logits.clone(), rows).token_ids
    assert tokens == expected.argmax(-1).tolist()
    assert tokens[1] == 7


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), enable_prefix_caching=True)


def test_a_large_bias_forces_a_token_and_a_large_negative_one_bans_it(llama):
    plain, forced = llama.generate(["Hello there"] * 2, [GREEDY, replace(GREEDY, logit_bias=((42, 100.0),))])
    assert forced.token_ids == [42] * 6
    assert plain.token_ids != forced.token_ids
    first = plain.token_ids[0]
    (banned,) = llama.generate(["Hello there"], replace(GREEDY, logit_bias=((first, -100.0),)))
    assert first not in banned.token_ids


def test_a_biased_request_leaves_the_others_in_its_batch_alone(llama):
    prompts = ["Once upon a time", "The cache"]
    alone = [output.token_ids for output in llama.generate(prompts, GREEDY)]
    batched = llama.generate([*prompts, "Hello"], [GREEDY, GREEDY, replace(GREEDY, logit_bias=((9, 50.0),))])
    assert [output.token_ids for output in batched[:2]] == alone


@pytest.mark.parametrize(
    ("logit_bias", "field"),
    [(((10**6, 1.0),), "logit_bias"), (((5, 100.5),), "logit_bias"), (((5, float("nan")),), "logit_bias")],
)
def test_a_bias_outside_the_vocabulary_or_range_is_refused(llama, logit_bias, field):
    with pytest.raises(InvalidRequestError) as error:
        llama.generate(["Hi"], SamplingParams(logit_bias=logit_bias))
    assert error.value.field == field
    assert not llama.engine.has_unfinished()


def test_prompt_logprobs_recompute_a_cached_prefix_and_match_hf(tiny_checkpoints, llama):
    """A cached prefix has no logits: a request that scores its prompt computes all of it, while the others
    keep reusing the cache."""
    prompt = llama.engine.inputs.prompt_token_ids("The quick brown fox jumps over the lazy dog, " * 3)
    assert len(prompt) > 2 * llama.engine.config.block_size
    llama.generate([prompt], GREEDY)  # now cached
    scheduler = llama.engine.core.scheduler
    hits_before = scheduler.prefix_cache_hit_tokens
    (scored,) = llama.generate([prompt], replace(GREEDY, prompt_logprobs=3))
    assert scheduler.prefix_cache_hit_tokens == hits_before
    llama.generate([prompt], GREEDY)
    assert scheduler.prefix_cache_hit_tokens > hits_before

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
    first, *entries = scored.prompt_logprobs
    assert first is None
    for position, entry in enumerate(entries):
        assert entry.token_id == prompt[position + 1]
        assert entry.logprob == pytest.approx(expected[position, entry.token_id].item(), abs=1e-4)
        top_values, top_ids = expected[position].topk(3)
        assert [token_id for token_id, _ in entry.top_logprobs] == top_ids.tolist()
        assert [logprob for _, logprob in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)
