"""Phi-3: q/k/v and gate/up stored fused in the checkpoint, and LongRoPE, whose long frequencies take over for a
sequence longer than the original context (HF then recomputes the sequence's whole cache, and so does kvserve).
The parity prompts of test_parity.py (1 to 70 tokens, 12 new each) against an original context of 32 cover
prompts below it, prompts past it, and a prompt of 31 whose output grows past it."""

from pathlib import Path

import pytest
import torch
from transformers import Phi3Config

from kvserve.engine import LLM
from kvserve.testing.tiny_checkpoint import write_random_checkpoint
from tests.test_parity import SCHEDULING_PATHS, assert_matches_hf, build_hf_reference

ORIGINAL_CONTEXT = 32
PATHS = ["one_batch", "staggered", "preempting", "chunked"]


@pytest.fixture(scope="module")
def phi3(tokenizer, tmp_path_factory) -> Path:
    generator = torch.Generator().manual_seed(0)
    head_dim = 8
    config = Phi3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=ORIGINAL_CONTEXT,
        initializer_range=0.1, pad_token_id=0, sliding_window=None, tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1 + torch.rand(head_dim // 2, generator=generator)).tolist(),
            "long_factor": (2 + 4 * torch.rand(head_dim // 2, generator=generator)).tolist(),
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
        },
        architectures=["Phi3ForCausalLM"],
    )  # fmt: skip
    return write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp("phi3") / "phi3", seed=11)


@pytest.fixture(scope="module")
def phi3_reference(phi3):
    return build_hf_reference(phi3)


def test_the_checkpoint_stores_the_projections_fused(phi3):
    from safetensors import safe_open

    with safe_open(str(phi3 / "model.safetensors"), "pt") as checkpoint:
        names = set(checkpoint.keys())
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= names


@pytest.mark.parametrize("path", PATHS)
def test_greedy_tokens_and_logprobs_match_hf(phi3, phi3_reference, path):
    assert_matches_hf(LLM(str(phi3), **SCHEDULING_PATHS[path]), phi3_reference, path)


def test_long_sequences_stay_out_of_the_prefix_cache_and_short_ones_share_it(phi3, phi3_reference):
    llm = LLM(str(phi3), enable_prefix_caching=True)
    assert_matches_hf(llm, phi3_reference, "one_batch")
    hits_before = llm.engine.core.scheduler.prefix_cache_hit_tokens
    assert_matches_hf(llm, phi3_reference, "one_batch")
    # The 17-token prompt finds its first block (rotated short); the 48-token one, past the original context,
    # would find two if it shared the cache (the 31- and 70-token requests score their prompts: no reuse).
    assert llm.engine.core.scheduler.prefix_cache_hit_tokens - hits_before == 16
