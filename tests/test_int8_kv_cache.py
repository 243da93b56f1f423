"""INT8 KV cache: per-token-and-head quantization, the torch and Triton paths reading it, its capacity,
and the engine running every scheduling path on it."""

import logging

import pytest
import torch

from kvserve.engine import LLM, EngineConfig, SamplingParams
from kvserve.kernels import (
    AttentionShape,
    PagedKV,
    paged_attention,
    quantize_per_token_head,
    select_backend,
    store_kv,
)
from kvserve.kernels.triton_store_kv import store_kv as triton_store_kv
from kvserve.kvcache import KVCacheSpec
from tests.paged_batches import HEAD_DIM, empty_cache, make_batch, on_device, reference_store
from tests.test_triton_kernels import DEVICE

INT8_BLOCK_BYTES = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.int8).bytes_per_block


def test_round_trip_error_is_at_most_half_a_step():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=generator) * torch.logspace(-3, 3, 64).view(64, 1, 1)
    data, scale = quantize_per_token_head(x)
    assert data.dtype == torch.int8 and scale.shape == (64, 4)
    dequantized = data.float() * scale.unsqueeze(-1)
    step = scale.unsqueeze(-1)
    assert ((dequantized - x).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (data.abs().amax(dim=-1) == 127).all()  # the absmax element maps to +-127


def test_rounds_to_nearest_not_toward_zero():
    x = torch.tensor([[127.0, 0.6, 0.4, -0.6, -0.5, 0.5, 126.5]])  # scale is exactly 1
    data, scale = quantize_per_token_head(x)
    assert scale.item() == 1.0
    assert data.tolist() == [[127, 1, 0, -1, -1, 1, 127]]


def test_a_zero_vector_stores_zeros_not_nan():
    data, scale = quantize_per_token_head(torch.zeros(3, 2, 8))
    assert (data == 0).all() and (scale == 0).all()
    cache = empty_cache((2, 4, 2, 8), torch.float32, int8=True)
    store_kv(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), cache, torch.tensor([5]))
    dequantized = cache.key.view(-1, 2, 8)[5].float() * cache.key_scale.view(-1, 2)[5].unsqueeze(-1)
    assert (dequantized == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_store_quantizes_as_the_torch_path_does(dtype):
    generator = torch.Generator().manual_seed(1)
    slot_mapping = torch.tensor([3, -1, 12, 0, 7])
    key = (torch.randn(5, 2, HEAD_DIM, generator=generator) * 3).to(dtype)
    value = torch.randn(5, 2, HEAD_DIM, generator=generator).to(dtype)
    value[2] = 0.0  # a zero vector among them
    shape = (4, 4, 2, HEAD_DIM)
    expected = empty_cache(shape, dtype, int8=True)
    reference_store(key, value, expected, slot_mapping)
    actual = on_device(empty_cache(shape, dtype, int8=True), DEVICE)
    triton_store_kv(key.to(DEVICE), value.to(DEVICE), actual, slot_mapping.to(DEVICE))

    for got, want in [(actual.key, expected.key), (actual.value, expected.value)]:
        # A different division rounding on a GPU may move a value sitting on a half step by one.
        assert (got.cpu().int() - want.int()).abs().max() <= 1
    torch.testing.assert_close(actual.key_scale.cpu(), expected.key_scale, equal_nan=True, rtol=1e-6, atol=0)
    torch.testing.assert_close(actual.value_scale.cpu(), expected.value_scale, equal_nan=True, rtol=1e-6, atol=0)
    assert actual.key_scale.isnan().sum() == expected.key_scale.numel() - 4 * 2  # 4 slots written


# (new tokens, context) per request: decodes first, then chunks over cached prefixes and a whole prompt.
MIXED_QUERY_LENS, MIXED_SEQ_LENS = [1, 1, 1, 9, 6], [37, 4, 18, 25, 6]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 4)])
def test_triton_and_torch_paths_agree_on_an_int8_cache(num_heads, num_kv_heads):
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, num_heads, num_kv_heads, torch.float32, seed=8, int8=True)
    expected = paged_attention(batch.query, batch.cache, batch.metadata, HEAD_DIM**-0.5)
    backend = select_backend("triton", DEVICE, AttentionShape(8, num_heads, HEAD_DIM))
    actual = backend.paged_attention(batch.query, batch.cache, batch.metadata, HEAD_DIM**-0.5)
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=1e-4, rtol=0)


def test_attention_over_int8_stays_close_to_full_precision():
    full = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, 8, 2, torch.float32, seed=9)
    int8 = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, 8, 2, torch.float32, seed=9, int8=True)
    exact = paged_attention(full.query, full.cache, full.metadata, HEAD_DIM**-0.5)
    approximate = paged_attention(int8.query, int8.cache, int8.metadata, HEAD_DIM**-0.5)
    error = (approximate - exact).abs()
    assert error.max() < 0.02 and error.mean() < 0.004  # outputs are O(1): keys and values are N(0, 1)


def test_int8_holds_about_twice_the_tokens_of_a_16_bit_cache_in_the_same_bytes():
    shape = {"num_layers": 28, "num_kv_heads": 8, "head_dim": 128}
    bf16, int8 = KVCacheSpec(**shape, dtype=torch.bfloat16), KVCacheSpec(**shape, dtype=torch.int8)
    assert int8.bytes_per_token == 2 * 28 * 8 * (128 + 4)  # data plus an fp32 scale per token and head
    budget = 1 << 30
    ratio = int8.num_blocks_for_budget(budget) / bf16.num_blocks_for_budget(budget)
    assert ratio == pytest.approx(256 / 132, rel=1e-3) and ratio >= 1.9


def test_an_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")


def test_paged_kv_requires_scales_with_int8_data_only():
    data = torch.zeros(2, 4, 1, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="scales"):
        PagedKV(data, data)
    with pytest.raises(ValueError, match="scales"):
        PagedKV(data.float(), data.float(), torch.zeros(2, 4, 1), torch.zeros(2, 4, 1))


NUM_NEW_TOKENS = 10
SCHEDULING_PATHS = {
    "staggered": {"max_num_seqs": 3},
    "preempting": {"kv_cache_memory_bytes": 10 * INT8_BLOCK_BYTES},
    "chunked_preempting": {"max_num_batched_tokens": 20, "kv_cache_memory_bytes": 10 * INT8_BLOCK_BYTES},
    "unchunked_no_prefix_cache": {"enable_chunked_prefill": False, "enable_prefix_caching": False},
}


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(4, 200, (33,), generator=generator).tolist()  # a cached prefix for the last two
    lengths = [1, 9, 17, 31, 48]
    prompts = [torch.randint(4, 200, (n,), generator=generator).tolist() for n in lengths]
    return [*prompts, [*shared, 5, 6], [*shared, 7]]


def _generate(model_dir, **overrides):
    llm = LLM(str(model_dir), kv_cache_dtype="int8", **overrides)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    return llm, llm.generate(_prompts(), params)


# Scheduling is what varies here; the parity tests cover every architecture.
@pytest.fixture(scope="module", params=["llama", "qwen3"])
def int8_model(request, tiny_checkpoints):
    return tiny_checkpoints[request.param]


@pytest.fixture(scope="module")
def int8_reference(int8_model):
    llm, outputs = _generate(int8_model)
    assert llm.engine.core.kv_cache.spec.dtype == torch.int8
    return outputs


@pytest.mark.parametrize("path", sorted(SCHEDULING_PATHS))
def test_int8_engine_gives_the_same_tokens_on_every_scheduling_path(int8_model, int8_reference, path):
    """Each token is quantized on its own, so batching, chunking, preemption and prefix reuse change nothing."""
    llm, outputs = _generate(int8_model, **SCHEDULING_PATHS[path])
    for expected, output in zip(int8_reference, outputs, strict=True):
        assert output.token_ids == expected.token_ids
        assert [e.logprob for e in output.logprobs] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    if "preempting" in path:
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.kv_usage().num_used_blocks == 0


def test_int8_engine_stays_close_to_the_full_precision_cache(int8_model, int8_reference):
    full = LLM(str(int8_model)).generate(
        _prompts(), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=0)
    )
    # The first token comes from the prompt alone, so both runs score it in the same context.
    for quantized, exact in zip(int8_reference, full, strict=True):
        assert quantized.logprobs[0].logprob == pytest.approx(exact.logprobs[0].logprob, abs=0.05)


def test_int8_engine_on_the_triton_backend(tiny_checkpoints):
    model_dir = tiny_checkpoints["qwen3"]
    _, on_torch = _generate(model_dir, **SCHEDULING_PATHS["chunked_preempting"])
    llm, on_triton = _generate(model_dir, attention_backend="triton", **SCHEDULING_PATHS["chunked_preempting"])
    for expected, output in zip(on_torch, on_triton, strict=True):
        assert output.token_ids == expected.token_ids
        assert [e.logprob for e in output.logprobs] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-3)
    assert llm.engine.kv_usage().num_used_blocks == 0


def test_engine_reports_int8_capacity_at_start_up(tiny_checkpoints, caplog):
    budget = 100 * INT8_BLOCK_BYTES + 5
    with caplog.at_level(logging.INFO, logger="kvserve.engine.kv_sizing"):
        llm = LLM(str(tiny_checkpoints["llama"]), kv_cache_dtype="int8", kv_cache_memory_bytes=budget)
    assert llm.engine.core.kv_cache.num_blocks == 100
    message = next(record.getMessage() for record in caplog.records if "KV cache" in record.getMessage())
    assert "torch.int8 + fp32 scales" in message
    assert f"= {100 * 16} tokens" in message and f"{INT8_BLOCK_BYTES // 16} bytes a token" in message
