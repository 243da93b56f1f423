"""Structured outputs under speculative decoding: the row after each draft is masked by a copy of the request's
grammar that has consumed the drafts before it, so greedy constrained outputs equal decoding without drafts, sampled
ones still match their constraint, and a draft the grammar refuses is never accepted."""

import pytest

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.sampling_params import GrammarSpec
from kvserve.engine.speculative import SpeculativeConfig, grammars_after_drafts
from tests.test_draft_model import draft_config, unlike_draft  # noqa: F401 (a fixture)
from tests.test_speculative_decoding import NGRAM, run
from tests.test_structured_outputs import CONSTRAINTS, MAX_TOKENS, PROMPTS

KV = {"kv_cache_memory_bytes": 4 << 20}
# Words from a small alphabet, up to 60 characters: the tiny model's constrained text falls into loops that prompt
# lookup then drafts.
LOOPING = GrammarSpec("regex", r"[a-e ]{1,60}")


def constrained(spec: GrammarSpec, **overrides) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, "structured_output": spec, **overrides})


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_greedy_constrained_outputs_equal_decoding_without_drafts(tiny_checkpoints, kind):
    spec, check = CONSTRAINTS[kind]
    model = str(tiny_checkpoints["llama"])
    plain = run(LLM(model, **KV), PROMPTS, constrained(spec))
    speculated = run(LLM(model, speculative_config=NGRAM, **KV), PROMPTS, constrained(spec))
    assert speculated.outputs == plain.outputs
    for _, text, reason in speculated.outputs:
        assert reason == "stop"
        check(text)


def test_drafts_of_constrained_requests_are_verified_and_accepted(tiny_checkpoints):
    model = str(tiny_checkpoints["llama"])
    plain = run(LLM(model, **KV), PROMPTS, constrained(LOOPING))
    speculated = run(LLM(model, speculative_config=NGRAM, **KV), PROMPTS, constrained(LOOPING))
    assert speculated.outputs == plain.outputs
    assert sum(speculated.verified) >= 3 and speculated.num_accepted > 20


def test_the_target_as_its_own_draft_model_has_constrained_drafts_accepted(tiny_checkpoints):
    # The draft model proposes without the grammar; the target's rows are masked after the drafts before them. A row
    # masked with the grammar's state before the drafts would sample tokens the grammar refuses there, which would
    # end the request (the grammar's check of each output token) or change the output.
    model = tiny_checkpoints["llama"]
    plain = run(LLM(str(model), **KV), PROMPTS, constrained(LOOPING))
    llm = LLM(str(model), speculative_config=draft_config(model), **KV)
    speculated = run(llm, PROMPTS, constrained(LOOPING))
    assert speculated.outputs == plain.outputs
    assert speculated.num_drafts > 30 and speculated.num_accepted > 0.5 * speculated.num_drafts


def test_a_draft_model_unlike_the_target_keeps_constrained_outputs(tiny_checkpoints, unlike_draft):  # noqa: F811
    # A random draft model, its proposals confined to the grammar: outputs stay the target's constrained ones.
    spec, check = CONSTRAINTS["regex"]
    model = str(tiny_checkpoints["llama"])
    plain = run(LLM(model, **KV), PROMPTS, constrained(spec))
    speculated = run(LLM(model, speculative_config=draft_config(unlike_draft), **KV), PROMPTS, constrained(spec))
    assert speculated.outputs == plain.outputs and speculated.num_drafts > 0
    for _, text, _ in speculated.outputs:
        check(text)


def test_sampled_constrained_outputs_with_drafts_match_and_reproduce(tiny_checkpoints):
    model = str(tiny_checkpoints["llama"])
    config = SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3, adaptive=False)
    for kind in ("json_schema", "grammar"):
        spec, check = CONSTRAINTS[kind]
        params = [constrained(spec, temperature=1.0, seed=seed) for seed in range(8)]
        first = run(LLM(model, speculative_config=config, **KV), PROMPTS * 2, params)
        again = run(LLM(model, speculative_config=config, **KV), PROMPTS * 2, params)
        assert first.outputs == again.outputs
        for _, text, reason in first.outputs:
            assert reason == "stop"
            check(text)


def test_grammar_copies_past_a_refused_draft_stay_where_the_grammar_last_accepted(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), **KV)
    grammar = llm.engine.core.grammars.matcher(GrammarSpec("regex", r"a{1,5}"))
    [a_token] = llm.engine.tokenizer.encode("a", add_special_tokens=False)
    [b_token] = llm.engine.tokenizer.encode("b", add_special_tokens=False)
    copies = grammars_after_drafts(grammar, [a_token, b_token, a_token])
    # After "a": another "a" or the end; past the refused "b", every copy stays after "a" (never an error state).
    for copy in copies:
        assert not copy.is_error()
        assert copy.validate_tokens([a_token]) == 1 and copy.validate_tokens([b_token]) == 0
    assert copies[0].validate_tokens([a_token] * 4) == 4 and copies[0].validate_tokens([a_token] * 5) == 4
    assert grammar.validate_tokens([a_token] * 5) == 5  # the request's own matcher consumed nothing
