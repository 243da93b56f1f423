"""Gemma 2 and Gemma 3 (text): (1 + weight) norms, scaled embeddings, GeGLU, sandwich norms, the query scale of
query_pre_attn_scalar, soft-capped attention scores and logits (Gemma 2), q/k norms and a rope of their own on
the local layers (Gemma 3), and sliding-window attention on the layers HF marks, through the paged path. The
window (12) is not a multiple of the block size (16) and the parity prompts run up to 70 tokens + 12 new."""

from pathlib import Path

import openai
import pytest
from transformers import Gemma2Config, Gemma3TextConfig

from kvserve.engine import LLM, SamplingParams
from kvserve.testing.tiny_checkpoint import write_random_checkpoint
from tests.server_harness import running_server
from tests.test_parity import (
    SCHEDULING_PATHS,
    assert_matches_hf,
    assert_prefix_cached_run_matches_hf,
    build_hf_reference,
)

WINDOW = 12
_COMMON = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "initializer_range": 0.1,
    "pad_token_id": 0, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"],
}  # fmt: skip
GEMMA_CONFIGS = {
    "gemma2": lambda vocab: Gemma2Config(
        vocab_size=vocab, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        architectures=["Gemma2ForCausalLM"], **_COMMON,
    ),
    "gemma3": lambda vocab: Gemma3TextConfig(
        vocab_size=vocab, architectures=["Gemma3ForCausalLM"], rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        }, **_COMMON,
    ),
}  # fmt: skip
PATHS = ["one_batch", "staggered", "preempting", "chunked", "chunked_preempting"]


@pytest.fixture(scope="module", params=sorted(GEMMA_CONFIGS))
def gemma(request, tokenizer, tmp_path_factory) -> Path:
    config = GEMMA_CONFIGS[request.param](len(tokenizer))
    return write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp("gemma") / request.param, seed=11)


@pytest.fixture(scope="module")
def gemma_reference(gemma):
    return build_hf_reference(gemma)


@pytest.mark.parametrize("path", PATHS)
def test_greedy_tokens_and_logprobs_match_hf(gemma, gemma_reference, path):
    assert_matches_hf(LLM(str(gemma), **SCHEDULING_PATHS[path]), gemma_reference, path)


def test_prefix_cached_prompts_match_hf(gemma, gemma_reference):
    assert_prefix_cached_run_matches_hf(gemma, gemma_reference)


def test_the_triton_backend_matches_hf(gemma, gemma_reference):
    """The Triton kernels' window and soft-cap (in the interpreter on a CPU), with chunks and preemption."""
    llm = LLM(str(gemma), attention_backend="triton", dtype="float32", **SCHEDULING_PATHS["chunked_preempting"])
    assert_matches_hf(llm, gemma_reference, "chunked_preempting")


def test_only_the_sliding_layers_have_a_window(gemma):
    layers = LLM(str(gemma)).engine.core.model.model.layers
    assert [layer.self_attn.sliding_window for layer in layers] == [WINDOW, None]


def test_served_with_the_openai_client(gemma):
    with running_server(model=str(gemma), served_model_name="tiny-gemma") as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        prompt = "The quick brown fox jumps over the lazy dog " * 3  # longer than the window
        streamed = client.completions.create(model="tiny-gemma", prompt=prompt, max_tokens=8, temperature=0,
                                             stream=True)  # fmt: skip
        text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
        whole = client.completions.create(model="tiny-gemma", prompt=prompt, max_tokens=8, temperature=0)
        assert whole.choices[0].text == text
        assert whole.usage.prompt_tokens > WINDOW
        (offline,) = LLM(str(gemma)).generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))
        assert offline.text == text
