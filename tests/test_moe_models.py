"""Mixture-of-experts checkpoints (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE with a dense layer) give
HF transformers' greedy tokens and logprobs on every scheduling path, as the dense families do."""

from pathlib import Path

import openai
import pytest
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from kvserve.engine import LLM
from kvserve.engine.models.moe import SparseMoeBlock
from kvserve.testing.tiny_checkpoint import write_random_checkpoint
from tests.server_harness import running_server
from tests.test_parity import (
    SCHEDULING_PATHS,
    assert_matches_hf,
    assert_prefix_cached_run_matches_hf,
    build_hf_reference,
)

_ATTENTION = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "initializer_range": 0.1, "tie_word_embeddings": False,
}  # fmt: skip
MOE_CONFIGS = {
    # Every layer sparse; the top-2 weights always renormalised.
    "mixtral": lambda vocab: MixtralConfig(
        vocab_size=vocab, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, architectures=["MixtralForCausalLM"],
        **_ATTENTION,
    ),
    # q/k/v biases, a shared expert behind a sigmoid gate, top-k weights not renormalised.
    "qwen2_moe": lambda vocab: Qwen2MoeConfig(
        vocab_size=vocab, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, rope_parameters={"rope_type": "default",
        "rope_theta": 10000.0}, architectures=["Qwen2MoeForCausalLM"], **_ATTENTION,
    ),
    # q/k norms, 8 experts with top-2 renormalised, layer 0 dense (mlp_only_layers).
    "qwen3_moe": lambda vocab: Qwen3MoeConfig(
        vocab_size=vocab, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0], rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        architectures=["Qwen3MoeForCausalLM"], **_ATTENTION,
    ),
}  # fmt: skip
PATHS = ["one_batch", "staggered", "preempting", "chunked"]


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def moe_model(request, tokenizer, tmp_path_factory) -> Path:
    config = MOE_CONFIGS[request.param](len(tokenizer))
    return write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp("moe") / request.param, seed=11)


@pytest.fixture(scope="module")
def moe_reference(moe_model):
    return build_hf_reference(moe_model)


@pytest.mark.parametrize("path", PATHS)
def test_greedy_tokens_and_logprobs_match_hf(moe_model, moe_reference, path):
    llm = LLM(str(moe_model), **SCHEDULING_PATHS[path])
    assert_matches_hf(llm, moe_reference, path)


def test_prefix_cached_prompts_match_hf(moe_model, moe_reference):
    assert_prefix_cached_run_matches_hf(moe_model, moe_reference)


def test_layers_have_experts_where_hf_puts_them(moe_model):
    layers = LLM(str(moe_model)).engine.core.model.model.layers
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in layers]
    assert sparse == ([False, True] if moe_model.name == "qwen3_moe" else [True, True])


@pytest.fixture(scope="module")
def qwen3_moe(tokenizer, tmp_path_factory) -> Path:
    config = MOE_CONFIGS["qwen3_moe"](len(tokenizer))
    return write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp("served") / "qwen3_moe", seed=11)


def test_served_with_the_openai_client_and_expert_load_in_the_metrics(qwen3_moe):
    with running_server(model=str(qwen3_moe), served_model_name="tiny-moe") as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model="tiny-moe", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
        )
        assert answer.choices[0].finish_reason in ("stop", "length")
        server.wait_until_idle()
        computed = answer.usage.prompt_tokens + answer.usage.completion_tokens - 1  # the last token is never run
        config = server.engine.core.model.config.moe
        per_expert = [server.metric("moe_expert_tokens_total", expert=str(e)) or 0 for e in range(config.num_experts)]
        # Every computed token went to top_k experts in each of the one sparse layer (layer 0 is dense).
        assert sum(per_expert) == computed * config.top_k * len(config.sparse_layers)
        assert server.metric("moe_expert_load_imbalance") >= 1
