"""Tensor parallelism on the CPU (gloo, ranks spawned as processes): the shard plan's arithmetic, and the split
engine's greedy tokens, logprobs and prompt logprobs equal to HF's (as the unsplit engine's are) on the
batched, chunked, preempting and prefix-cached paths, for Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norms,
tied embeddings), Gemma 2 (soft-capping, sliding windows) and the mixture-of-experts families (Mixtral, Qwen2-MoE
with its shared expert, Qwen3-MoE with a dense layer), at 2 ranks and at 4 (KV heads replicated), and for a model
with one KV head for 10 query heads and a vocabulary no rank count divides."""

from dataclasses import replace

import pytest
from transformers import LlamaConfig

from kvserve.engine import LLM
from kvserve.engine.models.decoder import DecoderConfig
from kvserve.engine.models.moe import MoeConfig
from kvserve.engine.models.rope import RopeConfig
from kvserve.engine.parallel.sharding import ShardPlan, Slice, TensorParallelError
from kvserve.kernels.cpu_extension import load_cpu_kernels
from kvserve.testing.tiny_checkpoint import write_random_checkpoint
from tests.test_parity import (
    assert_matches_hf,
    assert_prefix_cached_run_matches_hf,
    build_hf_reference,
    recorded_graph_replays,
)

# Batches of at most 4 requests, 20 tokens a step (prompts in chunks beside decodes), and 10 blocks: each rank
# holds half the KV heads, so half of test_parity's bytes for 10 blocks. Every path but the prefix cache at once.
SPLIT_PATH = {"max_num_seqs": 4, "max_num_batched_tokens": 20, "kv_cache_memory_bytes": 5 * 8192}


def _config(**fields) -> DecoderConfig:
    defaults = dict(
        vocab_size=515, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16,
        rms_norm_eps=1e-6, max_position_embeddings=512, rope=RopeConfig(head_dim=16, theta=10000.0),
    )  # fmt: skip
    return DecoderConfig(**{**defaults, **fields})


# --- The plan: which slice each rank loads ------------------------------------------------------------------------


def test_heads_mlp_and_vocabulary_split_into_equal_slices_padded_at_the_end():
    config = _config()
    plans = [ShardPlan.of(config, rank, 2) for rank in range(2)]
    assert [plan.num_heads for plan in plans] == [4, 4] and [plan.num_kv_heads for plan in plans] == [1, 1]
    assert [plan.checkpoint_slice("model.layers.0.self_attn.q_proj.weight") for plan in plans] == [
        Slice(0, 0, 64), Slice(0, 64, 64)
    ]  # fmt: skip
    assert [plan.checkpoint_slice("model.layers.1.self_attn.k_proj.bias") for plan in plans] == [
        Slice(0, 0, 16), Slice(0, 16, 16)
    ]  # fmt: skip
    assert plans[1].checkpoint_slice("model.layers.0.self_attn.o_proj.weight") == Slice(1, 64, 64)
    assert plans[1].checkpoint_slice("model.layers.0.mlp.up_proj.weight") == Slice(0, 64, 64)
    assert plans[1].checkpoint_slice("model.layers.0.mlp.down_proj.weight") == Slice(1, 64, 64)
    # 515 tokens: 258 rows a rank, the last rank's last row padding.
    assert [plan.vocab_rows for plan in plans] == [258, 258]
    assert [plan.checkpoint_slice("lm_head.weight") for plan in plans] == [Slice(0, 0, 258), Slice(0, 258, 257)]
    for name in (
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ):
        assert plans[1].checkpoint_slice(name) is None
    # Row-parallel biases are added once, after the sum.
    assert not plans[0].zero_on_this_rank("model.layers.0.self_attn.o_proj.bias")
    assert plans[1].zero_on_this_rank("model.layers.0.self_attn.o_proj.bias")
    assert not plans[1].zero_on_this_rank("model.layers.0.self_attn.q_proj.bias")


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "size", "kv_head_of_rank"), [
    (10, 1, 2, [0, 0]),  # one KV head for all: every rank holds it
    (8, 2, 4, [0, 0, 1, 1]),  # each KV head on the two ranks whose query heads use it
    (8, 8, 4, [0, 2, 4, 6]),  # no replication: two KV heads a rank
])  # fmt: skip
def test_with_fewer_kv_heads_than_ranks_each_is_replicated_on_the_ranks_that_use_it(
    num_heads, num_kv_heads, size, kv_head_of_rank
):
    config = _config(num_heads=num_heads, num_kv_heads=num_kv_heads, hidden_size=num_heads * 16)
    plans = [ShardPlan.of(config, rank, size) for rank in range(size)]
    assert [plan.first_kv_head for plan in plans] == kv_head_of_rank
    assert {plan.num_kv_heads for plan in plans} == {max(1, num_kv_heads // size)}
    for plan in plans:  # each rank's query heads use the KV heads it holds
        group = num_heads // num_kv_heads
        first_query_head = plan.rank * plan.num_heads
        assert first_query_head // group == plan.first_kv_head


@pytest.mark.parametrize(("fields", "size", "message"), [
    ({"num_heads": 6, "num_kv_heads": 2, "hidden_size": 96}, 4, "6 attention heads"),
    ({"num_heads": 12, "num_kv_heads": 3, "hidden_size": 192}, 4, "3 KV heads"),
    ({"intermediate_size": 100}, 8, "intermediate size of 100"),
    ({"moe": MoeConfig(4, 2, 60, True, (0, 1))}, 8, "expert intermediate size of 60"),
    ({"moe": MoeConfig(4, 2, 64, True, (0, 1), shared_expert_intermediate_size=36)}, 8, "shared expert .* of 36"),
    # Every layer sparse: the dense intermediate size is never used, so it need not divide.
    ({"moe": MoeConfig(4, 2, 64, True, (0, 1)), "intermediate_size": 100}, 8, None),
    ({"moe": MoeConfig(4, 2, 64, True, (1,)), "intermediate_size": 100}, 8, "intermediate size of 100"),
])  # fmt: skip
def test_a_split_that_does_not_divide_the_model_is_refused_naming_what(fields, size, message):
    if message is None:
        assert ShardPlan.of(_config(**fields), 0, size).size == size
        return
    with pytest.raises(TensorParallelError, match=message):
        ShardPlan.of(_config(**fields), 0, size)


def test_each_expert_and_the_shared_expert_split_by_their_own_intermediate_size():
    moe = MoeConfig(4, 2, 32, False, (1,), shared_expert_intermediate_size=48)
    plan = ShardPlan.of(_config(moe=moe), 1, 2)
    layer = "model.layers.1.mlp"
    assert plan.checkpoint_slice(f"{layer}.experts.3.gate_proj.weight") == Slice(0, 16, 16)
    assert plan.checkpoint_slice(f"{layer}.experts.0.down_proj.weight") == Slice(1, 16, 16)
    assert plan.checkpoint_slice(f"{layer}.shared_expert.up_proj.weight") == Slice(0, 24, 24)
    assert plan.checkpoint_slice(f"{layer}.shared_expert.down_proj.weight") == Slice(1, 24, 24)
    assert plan.checkpoint_slice("model.layers.0.mlp.down_proj.weight") == Slice(1, 64, 64)  # the dense layer
    # The router and the shared expert's gate are whole on every rank: each routes every token.
    assert plan.checkpoint_slice(f"{layer}.gate.weight") is None
    assert plan.checkpoint_slice(f"{layer}.shared_expert_gate.weight") is None


# --- The split engine against HF ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_reference(tiny_model):
    return build_hf_reference(tiny_model)


def test_two_ranks_give_hf_greedy_tokens_and_logprobs_batched_chunked_and_preempting(tiny_model, hf_reference):
    with LLM(str(tiny_model), tensor_parallel_size=2, **SPLIT_PATH) as llm:
        assert llm.engine.core.model.plan.size == 2 and llm.engine.core.kv_cache.spec.num_kv_heads == 1
        assert_matches_hf(llm, hf_reference, "chunked_preempting")


@pytest.mark.skipif(not load_cpu_kernels(), reason="the eager replay reads device buffers only with the C++ kernels")
def test_decode_graphs_replayed_on_both_ranks_give_hf_tokens(tiny_checkpoints):
    """Every rank captures the decode ladder (replayed eagerly here, as CUDA graphs on GPUs) and replays the size
    rank 0's plan names: a padded batch's all-reduces have one shape on both ranks, and the tokens are HF's."""
    model_dir = tiny_checkpoints["llama"]
    with LLM(str(model_dir), tensor_parallel_size=2, eager_graph_replay=True, **SPLIT_PATH) as llm:
        graphs = llm.engine.core.runner.worker.decode_graphs
        assert sorted(graphs.graphs) == [1, 2, 4]
        replays = recorded_graph_replays(llm)
        assert_matches_hf(llm, build_hf_reference(model_dir), "chunked_preempting")
    assert {3, 4} & set(replays)  # batches of 3 padded to 4, or full ones, were replayed


def test_two_ranks_with_a_cached_prefix_give_hf_tokens(tiny_checkpoints):
    model_dir = tiny_checkpoints["qwen3"]  # tied embeddings, q/k norms
    reference = build_hf_reference(model_dir)
    assert_prefix_cached_run_matches_hf(model_dir, reference, tensor_parallel_size=2)


def test_four_ranks_replicating_kv_heads_give_hf_tokens(tiny_checkpoints):
    model_dir = tiny_checkpoints["llama"]  # 8 query heads, 2 KV heads: each KV head on two of the four ranks
    with LLM(str(model_dir), tensor_parallel_size=4, max_num_seqs=4) as llm:
        assert llm.engine.core.model.plan.num_heads == 2 and llm.engine.core.model.plan.num_kv_heads == 1
        assert_matches_hf(llm, build_hf_reference(model_dir), "staggered")


@pytest.fixture(scope="module")
def one_kv_head_checkpoint(tmp_path_factory, tokenizer):
    """10 query heads for 1 KV head (5 : 1 on each of 2 ranks), tied embeddings, 515 tokens (odd: padded)."""
    config = LlamaConfig(
        vocab_size=515, hidden_size=80, intermediate_size=96, num_hidden_layers=2, num_attention_heads=10,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=512, initializer_range=0.1,
        tie_word_embeddings=True, attention_bias=True, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    return write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp("one-kv-head"), seed=11)


def test_one_kv_head_replicated_tied_embeddings_and_an_odd_vocabulary_give_hf_tokens(one_kv_head_checkpoint):
    reference = build_hf_reference(one_kv_head_checkpoint)
    # One KV head of 8 dims: a block is 2 KiB a rank, so 10 blocks take 20 KiB.
    settings = {**SPLIT_PATH, "kv_cache_memory_bytes": 10 * 2048}
    with LLM(str(one_kv_head_checkpoint), tensor_parallel_size=2, **settings) as llm:
        plans = llm.engine.core.model.plan
        assert (plans.num_heads, plans.num_kv_heads, plans.vocab_rows) == (5, 1, 258)
        assert_matches_hf(llm, reference, "chunked_preempting")


def test_a_bad_split_is_refused_before_any_rank_starts(tiny_checkpoints):
    with pytest.raises(TensorParallelError, match="does not divide 8 attention heads"):
        LLM(str(tiny_checkpoints["llama"]), tensor_parallel_size=3)


def test_settings_default_to_one_rank():
    from kvserve.engine import EngineConfig

    assert EngineConfig().tensor_parallel_size == 1
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        replace(EngineConfig(), tensor_parallel_size=0)


def test_gemma_2_split_over_two_ranks_gives_hf_tokens(tokenizer, tmp_path_factory):
    """Soft-capped scores and logits, sliding windows, sandwich norms and GeGLU, each rank over its heads."""
    from tests.test_gemma import GEMMA_CONFIGS

    config = GEMMA_CONFIGS["gemma2"](len(tokenizer))
    model_dir = write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp("gemma2-split"), seed=11)
    with LLM(str(model_dir), tensor_parallel_size=2, **SPLIT_PATH) as llm:
        assert_matches_hf(llm, build_hf_reference(model_dir), "chunked_preempting")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_mixture_of_experts_split_over_two_ranks_gives_hf_tokens(family, tokenizer, tmp_path_factory):
    """Every rank routes every token through its half of each expert (and of Qwen2-MoE's shared expert)."""
    from tests.test_moe_models import MOE_CONFIGS

    config = MOE_CONFIGS[family](len(tokenizer))
    model_dir = write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp(f"{family}-split"), seed=11)
    with LLM(str(model_dir), tensor_parallel_size=2, **SPLIT_PATH) as llm:
        assert llm.engine.core.model.plan.expert_intermediate_size == 16
        assert_matches_hf(llm, build_hf_reference(model_dir), "chunked_preempting")
