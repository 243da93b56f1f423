"""Paged batches for the kernel tests: random keys and values in shuffled blocks of a NaN-filled
cache, queries that are strided views, and the torch reference the kernels are held to."""

import math
from dataclasses import dataclass

import torch

from kvserve.kernels import AttentionMetadata, PagedKV, paged_attention, store_kv

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


def on_device(cache: PagedKV, device: torch.device) -> PagedKV:
    tensors = (cache.key, cache.value, cache.key_scale, cache.value_scale)
    return PagedKV(*(None if t is None else t.to(device) for t in tensors))


def make_batch(
    query_lens, seq_lens, num_heads, num_kv_heads, dtype, seed=0, head_dim=HEAD_DIM, int8=False, device=None
) -> PagedBatch:
    """Random keys and values of every context position in shuffled blocks; block 0 and spare blocks
    are never used and hold NaN, and block tables are padded with block 0. `int8`: an int8 cache.
    `device`: where the batch lives (default: CUDA if there is one, else the CPU)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return PagedBatch(wide[:, 1 : num_heads + 1].to(device), on_device(cache, device), metadata)


def reference(batch: PagedBatch) -> torch.Tensor:
    """The torch path on fp32 copies: the answer 16-bit kernels are held to within their tolerance."""
    cache = batch.cache
    if not cache.quantized:
        cache = PagedKV(cache.key.float(), cache.value.float())
    return paged_attention(batch.query.float(), cache, batch.metadata, scale=HEAD_DIM**-0.5)


def poisoned_like(query: torch.Tensor) -> torch.Tensor:
    return torch.full(query.shape, float("nan"), dtype=query.dtype, device=query.device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any(), "an output element was not written, or NaN leaked in"
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=TOLERANCE[dtype], rtol=0)


def reference_store(key: torch.Tensor, value: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor) -> None:
    """The torch store for a mapping with negative slots, which the kernels skip (the torch path takes none)."""
    valid = slot_mapping >= 0
    store_kv(key[valid], value[valid], cache, slot_mapping[valid])
