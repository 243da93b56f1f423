"""The Triton KV store, decode and extend kernels equal their torch references.

On a machine without a GPU they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), which
is slow, so shapes stay small. Every case reads its keys through shuffled block ids out of a cache
whose unused slots, padding block included, hold NaN, and writes into an output poisoned with NaN.
"""

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernels import AttentionMetadata, AttentionShape, PagedKV, paged_attention, select_attention_backend, store_kv
from kernels.triton_backend import num_decode_segments
from kernels.triton_decode_attention import DecodeWorkspace, paged_decode_attention
from kernels.triton_extend_attention import paged_extend_attention
from kernels.triton_store_kv import store_kv as triton_store_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEAD_DIM = 16
BLOCK_SIZE = 4
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GQA_SHAPES = [(4, 4), (8, 2), (16, 2), (6, 2)]  # (query heads, KV heads): ratios 1, 4, 8 and 3


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim], not contiguous
    cache: PagedKV
    metadata: AttentionMetadata


def empty_cache(shape: tuple, dtype: torch.dtype, int8: bool) -> PagedKV:
    """A cache whose every slot holds NaN (for int8 data, which cannot: NaN scales)."""
    if not int8:
        return PagedKV(torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
    data = [torch.full(shape, -128, dtype=torch.int8) for _ in range(2)]
    return PagedKV(*data, *(torch.full(shape[:-1], float("nan")) for _ in range(2)))


def on_device(cache: PagedKV) -> PagedKV:
    tensors = (cache.key, cache.value, cache.key_scale, cache.value_scale)
    return PagedKV(*(None if t is None else t.to(DEVICE) for t in tensors))


def make_batch(
    query_lens, seq_lens, num_heads, num_kv_heads, dtype, seed=0, head_dim=HEAD_DIM, int8=False
) -> PagedBatch:
    """Random keys and values of every context position in shuffled blocks; block 0 and spare blocks
    are never used and hold NaN, and block tables are padded with block 0. `int8`: an int8 cache."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = []
    for n in blocks_per_seq:
        tables.append(order[:n])
        order = order[n:]
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    cache = empty_cache((num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), dtype, int8)
    for table, seq_len in zip(tables, seq_lens, strict=True):
        positions = torch.arange(seq_len)
        slots = torch.tensor(table)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
        store_kv(keys, values, cache, slots)

    num_tokens = sum(query_lens)
    # A slice of a wider tensor, as the model's query is a view: strides are not those of a contiguous tensor.
    wide = torch.randn(num_tokens, num_heads + 2, head_dim, generator=generator).to(dtype)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),  # unused by attention
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return PagedBatch(wide[:, 1 : num_heads + 1].to(DEVICE), on_device(cache), metadata)


def reference(batch: PagedBatch) -> torch.Tensor:
    """The torch path on fp32 copies: the answer 16-bit kernels are held to within their tolerance."""
    cache = batch.cache
    if not cache.quantized:
        cache = PagedKV(cache.key.float(), cache.value.float())
    return paged_attention(batch.query.float(), cache, batch.metadata, scale=HEAD_DIM**-0.5)


def poisoned_like(query: torch.Tensor) -> torch.Tensor:
    return torch.full(query.shape, float("nan"), dtype=query.dtype, device=query.device)


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


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any(), "an output element was not written, or NaN leaked in"
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=TOLERANCE[dtype], rtol=0)


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
    store_kv(key, value, expected, slot_mapping)

    actual = on_device(empty_cache(shape, dtype, int8=False))
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
    backend = select_attention_backend("triton", DEVICE, AttentionShape(8, 4, 24))
    actual = backend.paged_attention(batch.query, batch.cache, batch.metadata, head_dim_scale)
    assert_close(actual, expected, torch.float32)


def test_backend_runs_decodes_and_extends_of_one_step():
    # Decodes first (as the scheduler orders them), then a chunk, a whole prompt and a one-token chunk.
    query_lens = [1, 1, 1, 8, 12, 1]
    seq_lens = [30, 4, 17, 24, 12, 6]
    batch = make_batch(query_lens, seq_lens, 8, 2, torch.float32, seed=7)
    assert batch.metadata.num_decodes == 3
    backend = select_attention_backend("triton", DEVICE, AttentionShape(8, 8, HEAD_DIM))
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
