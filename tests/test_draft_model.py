"""Speculative decoding with a draft model: greedy outputs token for token those of decoding without drafts on every
scheduling path, the draft's own KV cache kept right (every proposal is the draft's greedy decoding of the request's
text; a draft that is the target itself has every draft accepted), sampled outputs in the target's distribution
with a draft unlike the target, and the settings checked."""

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.default_model import default_draft_dir, default_model_dir
from kvserve.engine.speculative import SpeculativeConfig
from kvserve.engine.speculative.draft_model import DraftModel
from kvserve.testing.tiny_checkpoint import write_random_checkpoint
from tests.conftest import TINY_CONFIGS
from tests.test_speculative_decoding import (
    BLOCK_BYTES,
    GREEDY,
    NGRAM,
    copy_heavy_prompts,
    run,
    sampled_pairs_without_and_with_drafts,
)

KV = {"kv_cache_memory_bytes": 4 << 20}


def draft_config(model_dir) -> SpeculativeConfig:
    """Drafts verified in every decoding step (not adaptive: whatever the steps' times on this machine)."""
    return SpeculativeConfig(model=str(model_dir), num_speculative_tokens=3, adaptive=False)


@pytest.fixture(scope="module")
def unlike_draft(tmp_path_factory, tokenizer):
    """A one-layer Llama with the tiny models' tokenizer and weights of another seed: it proposes tokens the
    target often does not choose."""
    config = TINY_CONFIGS["llama"](len(tokenizer))
    config.num_hidden_layers = 1
    return write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp("draft") / "llama-1", seed=8)


def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_model):
    # The draft's KV is filled lazily (whole prompt first, then the tokens after its accepted drafts): were a token
    # never run through the draft, or run into the wrong slot, the draft would diverge from the target and its
    # drafts be rejected. (Rejections, which this draft never has, are test_every_proposal_is_the_drafts_....)
    prompts = [[(5 * i + 3 * j) % 300 + 20 for j in range(9 + i)] for i in range(4)]
    plain = run(LLM(str(tiny_model), **KV), prompts, GREEDY)
    llm = LLM(str(tiny_model), speculative_config=draft_config(tiny_model), **KV)
    speculated = run(llm, prompts, GREEDY)
    assert speculated.outputs == plain.outputs
    assert speculated.num_drafts > 60 and speculated.num_accepted >= 0.97 * speculated.num_drafts


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 24, "max_num_seqs": 4},  # chunked prefill beside verifying decodes
        {"kv_cache_memory_bytes": 24 * BLOCK_BYTES, "max_num_seqs": 6, "preemption": True},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 8, "max_num_seqs": 2},  # the budget caps a step's drafts
        {"kv_cache_dtype": "int8"},
    ],
    ids=["chunked-prefill", "preemption", "no-prefix-cache", "small-budget", "int8-kv"],
)
def test_greedy_outputs_equal_decoding_without_drafts_on_every_scheduling_path(tiny_checkpoints, settings):
    settings = dict(settings)
    preempts = settings.pop("preemption", False)
    settings = {**KV, **settings}
    model, prompts = tiny_checkpoints["llama"], copy_heavy_prompts(6)
    plain = run(LLM(str(model), **settings), prompts, GREEDY)
    llm = LLM(str(model), speculative_config=draft_config(model), **settings)
    speculated = run(llm, prompts, GREEDY)
    assert speculated.outputs == plain.outputs
    # The target as its draft: nearly every draft accepted, after preemptions too (the draft KV starts again).
    assert speculated.num_drafts > 30 and speculated.num_accepted >= 0.95 * speculated.num_drafts
    if preempts:
        assert llm.engine.core.scheduler.num_preemptions > 0  # else this case tests nothing of it


def test_a_draft_unlike_the_target_keeps_greedy_outputs(tiny_checkpoints, unlike_draft):
    model, prompts = tiny_checkpoints["llama"], copy_heavy_prompts(5)
    plain = run(LLM(str(model), **KV), prompts, GREEDY)
    llm = LLM(str(model), speculative_config=draft_config(unlike_draft), **KV)
    speculated = run(llm, prompts, GREEDY)
    assert speculated.outputs == plain.outputs
    assert all(speculated.verified)  # every request verified drafts
    assert speculated.num_accepted < 0.8 * speculated.num_drafts  # and many were turned away


@pytest.mark.parametrize(
    "settings",
    [
        {},
        # Preempted requests come back in other blocks (no prefix cache to find their old ones): a draft KV kept
        # across the preemption would be read from blocks other requests now fill.
        {"kv_cache_memory_bytes": 20 * BLOCK_BYTES, "max_num_seqs": 6, "enable_prefix_caching": False},
        {"max_num_batched_tokens": 24, "max_num_seqs": 4},
    ],
    ids=["plain", "preemption-without-prefix-cache", "chunked-prefill"],
)
def test_every_proposal_is_the_drafts_greedy_continuation(tiny_checkpoints, perturbed_draft, settings, monkeypatch):
    # With a draft that is often rejected, its KV must hold exactly the request's tokens: after each rejection it
    # computes the tokens after the accepted drafts again. Each proposal is checked against the draft model's own
    # greedy decoding (kvserve without speculation, HF-exact elsewhere) of the request's text at that step.
    model = tiny_checkpoints["llama"]
    settings = {**KV, **settings}
    proposals = []
    propose = DraftModel.propose

    def recording(draft_model, scheduled, *grammars_and_masks):
        propose(draft_model, scheduled, *grammars_and_masks)
        for item in scheduled:
            if item.num_draft_tokens:
                request = item.request
                proposals.append((request.prompt_token_ids + request.output_token_ids, list(request.draft_token_ids)))

    monkeypatch.setattr(DraftModel, "propose", recording)
    llm = LLM(str(model), speculative_config=draft_config(perturbed_draft), **settings)
    speculated = run(llm, copy_heavy_prompts(6), GREEDY)
    assert speculated.num_accepted < 0.9 * speculated.num_drafts  # drafts were rejected, many times
    if "enable_prefix_caching" in settings:
        assert llm.engine.core.scheduler.num_preemptions > 0
    sample = proposals[:: max(1, len(proposals) // 120)]
    expected = run(
        LLM(str(perturbed_draft), **KV), [tokens for tokens, _ in sample],
        [SamplingParams(max_tokens=len(drafts), temperature=0.0, ignore_eos=True) for _, drafts in sample],
    )  # fmt: skip
    mismatched = [i for i, (_, drafts) in enumerate(sample) if expected.outputs[i][0] != drafts]
    assert len(sample) > 30 and mismatched == []


def test_prefix_cache_hits_are_drafted_after_the_draft_computes_them(tiny_checkpoints):
    # A second round continues the first round's outputs from the prefix cache: the target skips the cached blocks,
    # the draft computes its KV in them (it never kept a block of its own), and every draft is still accepted.
    model, prompts = tiny_checkpoints["qwen3"], copy_heavy_prompts(3)
    llm = LLM(str(model), speculative_config=draft_config(model), **KV)
    first = run(llm, prompts, GREEDY)
    continued = [prompt + tokens for prompt, (tokens, _, _) in zip(prompts, first.outputs, strict=True)]
    hits_before = llm.engine.core.scheduler.prefix_cache_hit_tokens
    again = run(llm, continued, GREEDY)
    assert llm.engine.core.scheduler.prefix_cache_hit_tokens - hits_before >= 3 * 64
    assert again.outputs == run(LLM(str(model), **KV), continued, GREEDY).outputs
    assert again.num_drafts > 30 and again.num_accepted >= 0.95 * again.num_drafts
    assert llm.engine.kv_usage().num_used_blocks == 0


@pytest.fixture(scope="module")
def perturbed_draft(tiny_checkpoints, tokenizer, tmp_path_factory):
    """The tiny Llama with noise of half its weights' spread added to every weight: its greedy choice is often the
    target's and often not."""
    model = LlamaForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter += 0.5 * parameter.std() * torch.randn(parameter.shape, generator=generator)
    out = tmp_path_factory.mktemp("draft") / "llama-perturbed"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_sampled_outputs_follow_the_targets_distribution_with_a_draft_unlike_it(tiny_checkpoints, perturbed_draft):
    # As with prompt-lookup drafts (test_speculative_decoding.py), with a perturbed copy of the target as the draft:
    # the chi-square test over 1,200 draws must not reject at the 0.1% level.
    pvalue, num_accepted = sampled_pairs_without_and_with_drafts(
        tiny_checkpoints["llama"], draft_config(perturbed_draft)
    )
    assert num_accepted > 50  # drafts were verified, and accepted now and then
    assert pvalue > 0.001


def test_two_tensor_parallel_ranks_verify_a_draft_models_drafts(tiny_checkpoints, perturbed_draft):
    # The draft runs whole on rank 0 (its cache too: block ids mean the same on every rank), between the target's
    # steps; the ranks verify its drafts as one.
    model, prompts = tiny_checkpoints["llama"], copy_heavy_prompts(3)
    expected = run(LLM(str(model), **KV), prompts, GREEDY)
    with LLM(str(model), tensor_parallel_size=2, speculative_config=draft_config(perturbed_draft), **KV) as llm:
        speculated = run(llm, prompts, GREEDY)
        target_blocks = llm.engine.core.kv_cache.num_blocks
    assert speculated.outputs == expected.outputs
    assert speculated.num_drafts > 30 and 0 < speculated.num_accepted < speculated.num_drafts
    # Rank 0's budget, less its draft's cache (2 layers of 2 KV heads against its own 1 head of the target's 2
    # layers: a third), is the tightest, and every rank keeps that many blocks.
    with LLM(str(model), tensor_parallel_size=2, **KV) as alone:
        assert target_blocks == pytest.approx(alone.engine.core.kv_cache.num_blocks / 3, abs=1)


def test_the_draft_cache_takes_its_share_of_the_kv_budget(tiny_checkpoints, unlike_draft):
    model = tiny_checkpoints["llama"]
    alone = LLM(str(model), **KV).engine.core.kv_cache
    with_draft = LLM(str(model), speculative_config=draft_config(unlike_draft), **KV).engine.core
    # The target's cache holds 2 layers a token, the draft's 1 (the same heads): the budget splits 2 : 1.
    assert with_draft.kv_cache.num_blocks == pytest.approx(alone.num_blocks * 2 / 3, abs=1)
    draft_cache = with_draft.draft_model.worker.kv_cache
    assert draft_cache.num_blocks == with_draft.kv_cache.num_blocks
    assert with_draft.kv_cache.total_bytes + draft_cache.total_bytes <= KV["kv_cache_memory_bytes"]


def test_draft_settings_are_checked(tiny_checkpoints, tmp_path, tokenizer):
    model = tiny_checkpoints["llama"]
    assert SpeculativeConfig(model=str(model)).method == "draft_model"  # vLLM's form: a model implies the method
    with pytest.raises(ValueError, match="needs model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="model is the draft of method draft_model"):
        SpeculativeConfig(method="ngram", model=str(model))
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        SpeculativeConfig(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="prompt_lookup_max is not a setting of method 'draft_model'"):
        SpeculativeConfig(model=str(model), prompt_lookup_max=3)
    other_vocab = write_random_checkpoint(
        LlamaConfig(vocab_size=len(tokenizer) + 64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512),
        tokenizer, tmp_path / "other-vocab", seed=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(model), speculative_config=draft_config(other_vocab), **KV)
    with pytest.raises(ValueError, match="built-in model's draft"):
        LLM(str(model), speculative_config=SpeculativeConfig(model="default"), **KV)


def test_the_built_in_model_ships_a_draft_that_speeds_its_decoding_up_in_steps(tmp_path):
    # The shipped draft (benchmarks/train_default_draft.py) is small, shares the tokenizer, and its proposals are
    # accepted well beyond chance on the built-in model's own text.
    assert sum(path.stat().st_size for path in default_draft_dir().iterdir()) <= 2 << 20
    llm = LLM(str(default_model_dir()), speculative_config=SpeculativeConfig(model="default", adaptive=False), **KV)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    prompts = [tokenizer.encode(text) for text in ("In the beginning God created", "And the LORD said unto Moses,")]
    plain = run(LLM(str(default_model_dir()), **KV), prompts, SamplingParams(max_tokens=48, temperature=0.0))
    speculated = run(llm, prompts, SamplingParams(max_tokens=48, temperature=0.0))
    assert speculated.outputs == plain.outputs
    assert speculated.num_accepted >= 0.3 * speculated.num_drafts


def test_the_server_takes_default_and_serves_the_built_in_model_with_its_draft():
    import openai

    from kvserve.server.settings import load_settings
    from tests.server_harness import running_server

    settings = load_settings(None, {"speculative_config": "default"}, environ={})
    assert settings.engine_config().speculative_config == SpeculativeConfig(method="draft_model", model="default")
    with running_server(speculative_config="default", kv_cache_memory_bytes=4 << 20) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        prompt = "And God said, Let there be light: and there was light."
        expected = LLM(str(default_model_dir()), **KV).generate([prompt], SamplingParams(max_tokens=40, temperature=0))
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0)
        assert completion.choices[0].text == expected[0].text
        assert server.metric("spec_decode_num_accepted_tokens_total") > 0
        assert server.metric("spec_decode_num_draft_tokens_total") <= 4 * server.metric("spec_decode_num_drafts_total")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verifying_steps_replay_decode_graphs(tiny_checkpoints, perturbed_draft, method):
    # A verifying step is a pure decode of its tokens (each its own decode, its context up to its position), so it
    # replays the graph of its token count (eagerly here, as a CUDA graph on a GPU), with the eager engine's tokens
    # and logprobs.
    if torch.cuda.is_available():
        pytest.skip("a GPU replays real CUDA graphs (benchmarks/gpu_check.sh, step speculative)")
    from tests.test_parity import recorded_graph_replays

    model = str(tiny_checkpoints["llama"])
    config = NGRAM if method == "ngram" else draft_config(perturbed_draft)
    prompts = copy_heavy_prompts(3)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    settings = {"max_num_seqs": 12, **KV}
    expected = run(LLM(model, **settings), prompts, params)
    llm = LLM(model, eager_graph_replay=True, speculative_config=config, **settings)
    replays = recorded_graph_replays(llm)
    speculated = run(llm, prompts, params)
    assert speculated.outputs == expected.outputs and speculated.num_accepted > 0
    assert max(replays) >= 8  # steps of three requests with up to 3 drafts each (12 tokens) were replayed
    for deltas, reference in zip(speculated.deltas.values(), expected.deltas.values(), strict=True):
        got = [entry.logprob for delta in deltas for entry in delta.logprobs]
        want = [entry.logprob for delta in reference for entry in delta.logprobs]
        assert got == pytest.approx(want, abs=1e-4)
