"""Suffix decoding (engine/speculative/suffix_proposer.py): the most frequent continuation of the longest matching
suffix, in the request's own text and in a bounded pool of finished requests' outputs; its settings; and greedy
outputs token for token those of decoding without drafts, with drafts accepted, the pool's among them."""

import pytest

from kvserve.engine import LLM
from kvserve.engine.speculative import SpeculativeConfig, SuffixProposer
from kvserve.server.settings import load_settings
from tests.test_speculative_decoding import BLOCK_BYTES, GREEDY, copy_heavy_prompts, run, self_repeating_prompts


def suffix(**keys) -> SpeculativeConfig:
    return SpeculativeConfig(method="suffix", adaptive=False, **keys)


def test_the_most_frequent_continuation_of_the_longest_match_is_proposed():
    proposer = SuffixProposer(suffix(suffix_decoding_max_cached_requests=0))
    # "1 2" was followed by 3 twice and (latest) by 9 once: the frequent one wins, where prompt lookup takes 9.
    text = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 9, 6, 1, 2]
    assert proposer.propose(text, 1) == [3]
    # The longer match "6 1 2" occurred once, followed by 9: the longest match decides before frequency.
    assert proposer.propose([*text, 9, 6, 1, 2], 1) == [9]
    # A match of two tokens earns two draft tokens at most (max_spec_factor 1.0), however many are asked for.
    assert proposer.propose([5, 7, 8, 1, 2, 3, 4, 0, 0, 1, 2], 8) == [3, 4]
    assert proposer.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    # A loop runs on past the end of the text with its period (a match of five earns five drafts).
    assert proposer.propose([7, 1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    assert proposer.propose([9, 5, 5, 5, 5, 5], 8) == [5, 5, 5, 5]


def test_rare_continuations_are_not_proposed():
    text = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2]  # after "1 2": four tokens, a quarter each
    # 0.25 >= 0.1: of equally frequent ones the latest, 6, then the 1 that always followed it.
    assert SuffixProposer(suffix(suffix_decoding_max_cached_requests=0)).propose(text, 2) == [6, 1]
    strict = suffix(suffix_decoding_max_cached_requests=0, suffix_decoding_min_token_prob=0.3)
    assert SuffixProposer(strict).propose(text, 2) == []


def test_finished_outputs_are_matched_until_newer_ones_push_them_out():
    proposer = SuffixProposer(suffix(suffix_decoding_max_cached_requests=2))
    proposer.finished([40, 41, 42, 43, 44, 45])
    # A new request's text ends with "41 42": the pooled output goes on with 43 44 (a match of three tokens, the
    # pair and the 40 before it, earns three drafts at most).
    assert proposer.propose([7, 40, 41, 42], 5) == [43, 44, 45]
    assert proposer.propose([7, 44, 45], 5) == []  # the output ended there: nothing is proposed past its end
    proposer.finished([50, 51, 52, 53])
    proposer.finished([60, 61, 62, 63])  # the pool holds two outputs: the first one leaves
    assert proposer.propose([7, 40, 41, 42], 5) == []
    assert proposer.propose([7, 61, 62], 5) == [63]
    assert proposer.propose([1, 50, 51], 5) == [52, 53]  # a match of two: two drafts


def test_a_long_pool_keeps_its_index_in_step_with_its_tokens():
    proposer = SuffixProposer(suffix(suffix_decoding_max_cached_requests=3))
    for i in range(50):  # outputs come and go; the array is cut back now and then
        proposer.finished([1000 + i, 2000 + i, 3000 + i, 4000 + i])
    assert proposer.propose([9, 1049, 2049], 5) == [3049, 4049]
    assert proposer.propose([9, 1047, 2047], 5) == [3047, 4047]
    assert proposer.propose([9, 1046, 2046], 5) == []  # gone


def test_the_settings_of_each_method_are_checked():
    config = suffix()
    assert (config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests) == (24, 10000)
    assert (config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) == (1.0, 0.1)
    assert config.prompt_lookup_min is None
    with pytest.raises(ValueError, match="prompt_lookup_max is not a setting of method 'suffix'"):
        suffix(prompt_lookup_max=3)
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob is not a setting of method 'ngram'"):
        SpeculativeConfig(suffix_decoding_min_token_prob=0.5)
    for key, value in [("suffix_decoding_max_tree_depth", 0), ("suffix_decoding_max_cached_requests", -1),
                       ("suffix_decoding_max_spec_factor", 0.0), ("suffix_decoding_min_token_prob", 1.5)]:  # fmt: skip
        with pytest.raises(ValueError, match=key):
            suffix(**{key: value})
    flag = '{"method": "suffix", "suffix_decoding_max_cached_requests": 5}'
    settings = load_settings(None, {"speculative_config": flag})
    assert settings.engine_config().speculative_config.suffix_decoding_max_cached_requests == 5


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_outputs_equal_decoding_without_drafts(tiny_checkpoints, family):
    model, prompts = tiny_checkpoints[family], copy_heavy_prompts(4)
    plain = run(LLM(str(model), kv_cache_memory_bytes=4 << 20), prompts, GREEDY)
    speculated = run(LLM(str(model), kv_cache_memory_bytes=4 << 20, speculative_config=suffix()), prompts, GREEDY)
    assert speculated.outputs == plain.outputs
    assert speculated.num_accepted > 0


def test_greedy_outputs_hold_through_preemption_and_chunked_prefill(tiny_checkpoints):
    model, prompts = tiny_checkpoints["mistral"], copy_heavy_prompts(6)
    settings = {"kv_cache_memory_bytes": 16 * BLOCK_BYTES, "max_num_seqs": 6, "max_num_batched_tokens": 24}
    plain = run(LLM(str(model), **settings), prompts, GREEDY)
    llm = LLM(str(model), speculative_config=suffix(), **settings)
    speculated = run(llm, prompts, GREEDY)
    assert speculated.outputs == plain.outputs
    assert speculated.num_accepted > 0
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_a_request_asked_again_is_drafted_from_the_pool(tiny_checkpoints):
    """The same prompts twice: the second time, the first answers in the pool are the drafts, and most of them
    are accepted; without the pool the second pass accepts no more than the first."""
    model = tiny_checkpoints["llama"]
    prompts = [prompt[:6] for prompt in self_repeating_prompts(model, 4)]
    expected = run(LLM(str(model), kv_cache_memory_bytes=4 << 20), prompts, GREEDY).outputs
    accepted = {}
    for pooled in (0, 16):
        llm = LLM(str(model), kv_cache_memory_bytes=4 << 20,
                  speculative_config=suffix(suffix_decoding_max_cached_requests=pooled))  # fmt: skip
        first, second = run(llm, prompts, GREEDY), run(llm, prompts, GREEDY)
        assert first.outputs == second.outputs == expected
        accepted[pooled] = (first.num_accepted, second.num_accepted)
    assert accepted[0][1] == accepted[0][0]
    num_output_tokens = sum(len(tokens) for tokens, _, _ in expected)
    assert accepted[16][1] > max(accepted[16][0], num_output_tokens // 2)
