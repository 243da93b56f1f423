"""The C++ CPU kernels equal their torch references: KV store (int8 quantization included), decode
attention, and the fused layer ops (RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary embeddings).

Attention cases read keys through shuffled block ids out of a cache whose unused slots hold NaN,
into an output poisoned with NaN, as the Triton tests do.
"""

import pytest
import torch

from kvserve.kernels import AttentionShape, paged_attention, select_backend, torch_layer_ops
from kvserve.kernels.cpu_backend import CpuBackend
from kvserve.kernels.cpu_extension import load_cpu_kernels
from tests.paged_batches import (
    BLOCK_SIZE,
    GQA_SHAPES,
    HEAD_DIM,
    assert_close,
    empty_cache,
    make_batch,
    poisoned_like,
    reference,
    reference_store,
)

CPU = torch.device("cpu")
BACKEND = CpuBackend()
pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="no C++ compiler to build the CPU kernels")


def cpp_decode(batch, head_dim: int = HEAD_DIM) -> torch.Tensor:
    out = poisoned_like(batch.query)
    cache, meta = batch.cache, batch.metadata
    torch.ops.kvserve_cpu.paged_decode_attention(
        out, batch.query, cache.key, cache.value, cache.key_scale, cache.value_scale, meta.block_tables,
        meta.seq_lens, head_dim**-0.5,
    )  # fmt: skip
    return out


def test_auto_picks_the_cpp_kernels_on_a_cpu():
    assert select_backend("auto", CPU, AttentionShape(8, 8, HEAD_DIM)).name == "cpu"


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_writes_as_the_torch_path_does_and_skips_negative_slots(dtype, int8):
    generator = torch.Generator().manual_seed(0)
    slot_mapping = torch.tensor([9, -1, 0, 23, 4, -1, 17])
    num_kv_heads = 3
    wide_key = torch.randn(len(slot_mapping), num_kv_heads, HEAD_DIM + 8, generator=generator).to(dtype) * 3
    key = wide_key[..., 4 : HEAD_DIM + 4]  # not contiguous
    value = torch.randn(len(slot_mapping), num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
    value[2] = 0.0  # a zero vector: scale 0, data 0
    shape = (6, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    expected, actual = empty_cache(shape, dtype, int8), empty_cache(shape, dtype, int8)
    reference_store(key, value, expected, slot_mapping)
    BACKEND.store_kv(key, value, actual, slot_mapping)
    for name in ("key", "value", "key_scale", "value_scale"):
        if getattr(expected, name) is not None:
            torch.testing.assert_close(getattr(actual, name), getattr(expected, name), equal_nan=True, atol=0, rtol=0)
    untouched = actual.key_scale if int8 else actual.key
    assert untouched.isnan().sum() == untouched.numel() - 5 * untouched[0, 0].numel()  # only 5 slots written


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
def test_decode_matches_reference_across_gqa_ratios(num_heads, num_kv_heads):
    seq_lens = [1, 3, 4, 5, 17, 40]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, torch.float32, device=CPU)
    assert_close(cpp_decode(batch), reference(batch), torch.float32)


@pytest.mark.parametrize("head_dim", [24, 64, 128])  # one not a multiple of the 16-float vectors; production sizes
@pytest.mark.parametrize("int8", [False, True])
def test_decode_matches_reference_at_other_head_dims_and_on_int8(head_dim, int8):
    seq_lens = [2, 33, 70, 129]
    batch = make_batch([1] * 4, seq_lens, 8, 2, torch.float32, seed=1, head_dim=head_dim, int8=int8, device=CPU)
    expected = paged_attention(batch.query, batch.cache, batch.metadata, head_dim**-0.5)
    assert_close(cpp_decode(batch, head_dim), expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_matches_reference_in_16_bit(dtype):
    seq_lens = [2, 9, 33, 64]
    batch = make_batch([1] * len(seq_lens), seq_lens, 8, 2, dtype, seed=2, device=CPU)
    out = cpp_decode(batch)
    assert out.dtype == dtype
    assert_close(out, reference(batch), dtype)


def test_backend_runs_decodes_and_prompt_chunks_of_one_step():
    # Decodes first (as the scheduler orders them), then a chunk after a prefix, a whole prompt and a one-token chunk.
    query_lens = [1, 1, 1, 8, 12, 1]
    seq_lens = [30, 4, 17, 24, 12, 6]
    batch = make_batch(query_lens, seq_lens, 8, 2, torch.float32, seed=3, device=CPU)
    assert batch.metadata.num_decodes == 3
    actual = BACKEND.paged_attention(batch.query, batch.cache, batch.metadata, HEAD_DIM**-0.5)
    assert_close(actual, reference(batch), torch.float32)


@pytest.mark.parametrize("int8", [False, True])
def test_a_few_tokens_per_request_run_as_decodes_of_their_own(int8):
    # Requests verifying drafts (a few tokens after their context) among decodes, then a prompt chunk too long for
    # that, then a short one after it: the leading short ones go through the decode kernel a token a row, causally.
    query_lens = [1, 5, 1, 3, 40, 2]
    seq_lens = [30, 21, 17, 9, 56, 6]
    batch = make_batch(query_lens, seq_lens, 8, 2, torch.float32, seed=5, device=CPU, int8=int8)
    rows = batch.metadata.decode_rows
    assert (rows.num_seqs, rows.num_tokens) == (4, 10)
    assert rows.seq_lens.tolist() == [30, 17, 18, 19, 20, 21, 17, 7, 8, 9]
    actual = BACKEND.paged_attention(batch.query, batch.cache, batch.metadata, HEAD_DIM**-0.5)
    assert_close(actual, reference(batch), torch.float32)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.0, torch.float16: 0.0}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32 to 1e-5; 16-bit results to one unit in the last place of their dtype."""
    ulp = torch.finfo(dtype).eps * expected.float().abs().clamp_min(1.0)
    assert ((actual.float() - expected.float()).abs() <= ulp + TOLERANCE[dtype]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_and_residual_add(dtype):
    generator = torch.Generator().manual_seed(4)
    x, residual = (torch.randn(37, 72, generator=generator).to(dtype) for _ in range(2))
    weight = torch.randn(72, generator=generator).to(dtype)
    _close(BACKEND.rms_norm(x, weight, 1e-6), torch_layer_ops.rms_norm(x, weight, 1e-6), dtype)
    expected_norm, expected_sum = torch_layer_ops.add_rms_norm(x, residual, weight, 1e-6)
    norm, summed = BACKEND.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    _close(norm, expected_norm, dtype)
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)


def test_rms_norm_of_each_head_of_a_strided_view():
    # Qwen3's q/k norm: each head of the query, a view into the packed q/k/v output.
    packed = torch.randn(9, 6 * 16, generator=torch.Generator().manual_seed(5))
    query = packed[:, :64].view(9, 4, 16)
    weight = torch.rand(16) + 0.5
    _close(BACKEND.rms_norm(query, weight, 1e-6), torch_layer_ops.rms_norm(query, weight, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_over_the_whole_range(dtype):
    # 40 columns: two 16-wide vectors and a scalar tail; gates from -90 to 90 (exp under- and overflow).
    gate = torch.linspace(-90, 90, 23 * 40).view(23, 40)
    up = torch.randn(23, 40, generator=torch.Generator().manual_seed(6))
    packed = torch.cat([gate, up], dim=1).to(dtype)
    _close(BACKEND.silu_and_mul(packed), torch_layer_ops.silu_and_mul(packed), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_rotates_strided_query_and_key_in_place(dtype):
    generator = torch.Generator().manual_seed(7)
    packed = torch.randn(11, (8 + 2 + 2) * 32, generator=generator).to(dtype)
    query, key = packed[:, : 8 * 32].view(11, 8, 32), packed[:, 8 * 32 : 10 * 32].view(11, 2, 32)
    positions = torch.randint(0, 500, (11,), generator=generator)
    angles = torch.outer(torch.arange(500.0), 1.0 / 10000 ** (torch.arange(0, 32, 2) / 32))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    expected_query, expected_key = torch_layer_ops.rotary_embedding(positions, query, key, cos, sin)
    rotated_query, rotated_key = BACKEND.rotary_embedding(positions, query, key, cos, sin)
    assert rotated_query.data_ptr() == query.data_ptr()  # in place, in the packed output
    # bfloat16: the reference rounds after each product, the kernel once, in fp32: two ulps of the largest value
    tolerance = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * packed.float().abs().max().item()
    torch.testing.assert_close(rotated_query.float(), expected_query.float(), atol=tolerance, rtol=0)
    torch.testing.assert_close(rotated_key.float(), expected_key.float(), atol=tolerance, rtol=0)
