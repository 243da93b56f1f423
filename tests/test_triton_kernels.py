"""The Triton KV store, decode and extend kernels equal their torch references.

On a machine without a GPU they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), which
is slow, so shapes stay small. Every case reads its keys through shuffled block ids out of a cache
whose unused slots, padding block included, hold NaN, and writes into an output poisoned with NaN.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.kernels import AttentionMetadata, AttentionShape, paged_attention, select_backend
from kvserve.kernels.triton_backend import num_decode_segments
from kvserve.kernels.triton_decode_attention import DecodeWorkspace, paged_decode_attention
from kvserve.kernels.triton_extend_attention import paged_extend_attention
from kvserve.kernels.triton_store_kv import store_kv as triton_store_kv
from tests.paged_batches import (
    BLOCK_SIZE,
    GQA_SHAPES,
    HEAD_DIM,
    PagedBatch,
    assert_close,
    empty_cache,
    make_batch,
    on_device,
    poisoned_like,
    reference,
    reference_store,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def decode(batch: PagedBatch, num_segments: int, block_n: int = 16) -> torch.Tensor:
    num_seqs, num_heads, head_dim = batch.query.shape
    workspace = DecodeWorkspace.allocate(num_seqs, num_heads, head_dim, max_segments=8, device=DEVICE)
    out = poisoned_like(batch.query)
    meta = batch.metadata
    paged_decode_attention(
        batch.query, batch.cache, meta.block_tables, meta.seq_lens, HEAD_DIM**-0.5, num_segments, workspace, out,
        block_n=block_n,
    )  # fmt: skip
    return out


def extend(batch: PagedBatch, first_seq: int = 0, block_m: int = 16, block_n: int = 16) -> torch.Tensor:
    out = poisoned_like(batch.query)
    meta = batch.metadata
    paged_extend_attention(
        batch.query, batch.cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, HEAD_DIM**-0.5,
        first_seq, meta.num_seqs - first_seq, meta.max_query_len, out, block_m=block_m, block_n=block_n,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_each_token_to_its_slot_and_skips_negative_slots(dtype):
    num_blocks, num_kv_heads = 6, 3
    generator = torch.Generator().manual_seed(0)
    slot_mapping = torch.tensor([9, -1, 0, 23, 4, -1, 17])
    wide_key = torch.randn(len(slot_mapping), num_kv_heads, HEAD_DIM + 8, generator=generator).to(dtype)
    key = wide_key[..., 4 : HEAD_DIM + 4]  # not contiguous
    value = torch.randn(len(slot_mapping), num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    expected = empty_cache(shape, dtype, int8=False)
    reference_store(key, value, expected, slot_mapping)

    actual = on_device(empty_cache(shape, dtype, int8=False), DEVICE)
    triton_store_kv(key.to(DEVICE), value.to(DEVICE), actual, slot_mapping.to(DEVICE))

    torch.testing.assert_close(actual.key.cpu(), expected.key, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(actual.value.cpu(), expected.value, equal_nan=True, atol=0, rtol=0)
    assert actual.key.isnan().sum() == expected.key.numel() - 5 * num_kv_heads * HEAD_DIM  # only 5 slots written


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
def test_decode_matches_reference_across_gqa_ratios(num_heads, num_kv_heads):
    seq_lens = [1, 3, 4, 5, 17, 40]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, torch.float32)
    assert_close(decode(batch, num_segments=1), reference(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_matches_reference_in_16_bit(dtype):
    seq_lens = [2, 9, 33]
    batch = make_batch([1] * len(seq_lens), seq_lens, 8, 2, dtype, seed=1)
    out = decode(batch, num_segments=2)
    assert out.dtype == dtype
    assert_close(out, reference(batch), dtype)


def test_one_and_many_segments_agree_and_empty_segments_are_harmless():
    # With 16-token tiles, 5 segments of the 1- to 20-token sequences are mostly empty.
    seq_lens = [1, 7, 20, 61, 90]
    batch = make_batch([1] * len(seq_lens), seq_lens, 8, 2, torch.float32, seed=2)
    expected = reference(batch)
    one = decode(batch, num_segments=1)
    for num_segments in (2, 5, 8):
        many = decode(batch, num_segments=num_segments)
        assert_close(many, expected, torch.float32)
        torch.testing.assert_close(many, one, atol=1e-6, rtol=0)


def test_decode_refuses_more_segments_than_the_workspace_holds():
    batch = make_batch([1], [5], 4, 4, torch.float32)
    with pytest.raises(ValueError, match="exceed the workspace"):
        decode(batch, num_segments=9)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
def test_extend_matches_reference_over_prefix_and_causal_part(num_heads, num_kv_heads):
    # (new tokens, context): a whole prompt, chunks after cached prefixes, one token after a prefix,
    # and 35 rows that span three 16-row tiles.
    query_lens = [5, 7, 1, 35, 16]
    seq_lens = [5, 19, 10, 35, 33]
    batch = make_batch(query_lens, seq_lens, num_heads, num_kv_heads, torch.float32, seed=3)
    assert_close(extend(batch), reference(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_matches_reference_in_16_bit(dtype):
    batch = make_batch([6, 18], [6, 30], 8, 2, dtype, seed=4)
    out = extend(batch)
    assert out.dtype == dtype
    assert_close(out, reference(batch), dtype)


def test_extend_leaves_rows_of_earlier_sequences_alone():
    batch = make_batch([1, 1, 9], [4, 12, 20], 4, 2, torch.float32, seed=5)
    out = extend(batch, first_seq=2)
    assert out[:2].isnan().all()
    assert_close(out[2:], reference(batch)[2:], torch.float32)


def test_non_power_of_two_head_dim():
    batch = make_batch([1, 1, 6], [9, 30, 14], 4, 2, torch.float32, seed=6, head_dim=24)
    head_dim_scale = 24**-0.5
    expected = paged_attention(batch.query, batch.cache, batch.metadata, head_dim_scale)
    backend = select_backend("triton", DEVICE, AttentionShape(8, 4, 24))
    actual = backend.paged_attention(batch.query, batch.cache, batch.metadata, head_dim_scale)
    assert_close(actual, expected, torch.float32)


def test_backend_runs_decodes_and_extends_of_one_step():
    # Decodes first (as the scheduler orders them), then a chunk, a whole prompt and a one-token chunk.
    query_lens = [1, 1, 1, 8, 12, 1]
    seq_lens = [30, 4, 17, 24, 12, 6]
    batch = make_batch(query_lens, seq_lens, 8, 2, torch.float32, seed=7)
    assert batch.metadata.num_decodes == 3
    backend = select_backend("triton", DEVICE, AttentionShape(8, 8, HEAD_DIM))
    actual = backend.paged_attention(batch.query, batch.cache, batch.metadata, HEAD_DIM**-0.5)
    assert_close(actual, reference(batch), torch.float32)


def test_metadata_counts_leading_decodes():
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(5, dtype=torch.int64), query_start_loc=torch.tensor([0, 1, 2, 4, 5]),
        seq_lens=torch.tensor([3, 4, 6, 2]), block_tables=torch.zeros(4, 1, dtype=torch.int32),
        query_lens_cpu=[1, 1, 2, 1], seq_lens_cpu=[3, 4, 6, 2],
    )  # fmt: skip
    assert (metadata.num_decodes, metadata.max_query_len, metadata.max_seq_len) == (2, 2, 6)


def test_segment_count_fills_the_gpu_without_tiny_segments():
    assert num_decode_segments(num_seqs=1, num_kv_heads=8, max_seq_len=8192, target_programs=264) == 16
    assert num_decode_segments(num_seqs=1, num_kv_heads=8, max_seq_len=600, target_programs=264) == 3
    assert num_decode_segments(num_seqs=128, num_kv_heads=8, max_seq_len=8192, target_programs=264) == 1
    assert num_decode_segments(num_seqs=4, num_kv_heads=8, max_seq_len=32768, target_programs=264) == 9


def test_kernels_compile_for_hopper_with_the_real_compiler():
    """The interpreter skips Triton's compiler; this builds every kernel's cubin for sm_90 (H100/H200)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_compile_check.py")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all kernels compile" in result.stdout
