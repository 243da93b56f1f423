"""Sliding-window attention and score soft-capping (Gemma 2 and 3) in the torch paged path, against the attention
written out densely; the blocks wholly before a request's window are poisoned with NaN, so reading one fails."""

import pytest
import torch

from kvserve.kernels import PagedKV, paged_attention
from tests.paged_batches import BLOCK_SIZE, HEAD_DIM, make_batch

SCALE = HEAD_DIM**-0.5
# (query lens, seq lens): decodes first, then prompt chunks with and without context; short and long sequences.
BATCHES = [([1, 1, 1], [3, 9, 23]), ([1, 5, 7], [13, 5, 19]), ([6, 11], [30, 11])]


def dense(query, keys, values, window, softcap):
    """Rows of `query` at the last positions of keys/values [L, kv_heads, D], every score written out."""
    query_len, num_keys = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    k, v = (x.repeat_interleave(group, dim=1).float() for x in (keys, values))
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * SCALE
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_positions = torch.arange(num_keys - query_len, num_keys)[:, None]
    key_positions = torch.arange(num_keys)
    visible = key_positions <= query_positions
    if window is not None:
        visible &= query_positions - key_positions < window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def request_context(cache: PagedKV, table: torch.Tensor, seq_len: int):
    blocks = table[: -(-seq_len // BLOCK_SIZE)]
    return [x.index_select(0, blocks).flatten(0, 1)[:seq_len] for x in (cache.key, cache.value)]


@pytest.mark.parametrize(("query_lens", "seq_lens"), BATCHES)
@pytest.mark.parametrize("window", [None, 1, 3, 6, 9])  # none, and not multiples of the block size (4)
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_windowed_and_capped_attention_equals_the_dense_computation(query_lens, seq_lens, window, softcap):
    batch = make_batch(query_lens, seq_lens, num_heads=8, num_kv_heads=2, dtype=torch.float32, device="cpu")
    metadata, cache = batch.metadata, batch.cache
    expected, start = [], 0
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        keys, values = request_context(cache, metadata.block_tables[i], seq_len)
        rows = batch.query[start : start + query_len]
        expected.append(dense(rows, keys, values, window, softcap))
        start += query_len
    if window is not None:
        poison_blocks_before_windows(cache, metadata, query_lens, seq_lens, window)
    actual = paged_attention(batch.query, cache, metadata, SCALE, sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(actual, torch.cat(expected), atol=1e-5, rtol=0)


def poison_blocks_before_windows(cache: PagedKV, metadata, query_lens, seq_lens, window: int) -> None:
    """NaN in every block that ends before the first position a request's queries can see."""
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        first_visible = max(0, seq_len - query_len - window + 1)
        for block in metadata.block_tables[i, : first_visible // BLOCK_SIZE].tolist():
            cache.key[block] = float("nan")
            cache.value[block] = float("nan")


def test_a_window_wider_than_the_context_changes_nothing():
    batch = make_batch([1, 4], [7, 10], num_heads=4, num_kv_heads=4, dtype=torch.float32, device="cpu")
    full = paged_attention(batch.query, batch.cache, batch.metadata, SCALE)
    windowed = paged_attention(batch.query, batch.cache, batch.metadata, SCALE, sliding_window=64)
    torch.testing.assert_close(windowed, full, atol=1e-6, rtol=0)
