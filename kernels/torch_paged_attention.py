"""Torch paged attention: the CPU path of the engine and the reference for the Triton kernels.

Requests that decode one token are batched into one gather over their block tables; requests
with several new tokens (prefill, or recompute after preemption) attend one by one to their
cached prefix plus the causal part of their own tokens.
"""

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the cache slots; slots < 0 are skipped."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_heads, head_dim] over each request's paged context."""
    output = torch.empty_like(query)
    decode_rows = [i for i, query_len in enumerate(metadata.query_lens_cpu) if query_len == 1]
    if decode_rows:
        _decode(query, key_cache, value_cache, metadata, scale, decode_rows, output)
    starts = metadata.query_start_loc.tolist()
    for i, query_len in enumerate(metadata.query_lens_cpu):
        if query_len > 1:
            _extend(query, key_cache, value_cache, metadata, scale, i, starts[i], output)
    return output


def _decode(query, key_cache, value_cache, metadata, scale, rows, output) -> None:
    block_size = key_cache.shape[1]
    all_rows = len(rows) == metadata.num_seqs
    row_index = None if all_rows else torch.tensor(rows, device=query.device)
    token_index = metadata.query_start_loc[:-1] if all_rows else metadata.query_start_loc[row_index]
    seq_lens = metadata.seq_lens if all_rows else metadata.seq_lens[row_index]
    max_seq_len = max(metadata.seq_lens_cpu[i] for i in rows)
    num_blocks = -(-max_seq_len // block_size)
    block_tables = metadata.block_tables[:, :num_blocks]
    if not all_rows:
        block_tables = block_tables[row_index]
    keys = _gather(key_cache, block_tables, max_seq_len)  # [B, L, kv_heads, D]
    values = _gather(value_cache, block_tables, max_seq_len)
    valid = torch.arange(max_seq_len, device=query.device)[None, :] < seq_lens[:, None]  # [B, L]
    # Padded positions may hold anything (stale or NaN): zero them so 0-weight x NaN cannot leak.
    values = values.masked_fill(~valid[:, :, None, None], 0.0)
    keys = keys.masked_fill(~valid[:, :, None, None], 0.0)
    queries = query[token_index].unsqueeze(2)  # [B, heads, 1, D]
    out = F.scaled_dot_product_attention(
        queries,
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    output[token_index] = out.squeeze(2)


def _extend(query, key_cache, value_cache, metadata, scale, seq_index, query_start, output) -> None:
    block_size = key_cache.shape[1]
    query_len = metadata.query_lens_cpu[seq_index]
    seq_len = metadata.seq_lens_cpu[seq_index]
    block_table = metadata.block_tables[seq_index, : -(-seq_len // block_size)]
    keys = _gather(key_cache, block_table[None], seq_len)[0].transpose(0, 1)  # [kv_heads, L, D]
    values = _gather(value_cache, block_table[None], seq_len)[0].transpose(0, 1)
    queries = query[query_start : query_start + query_len].transpose(0, 1)  # [heads, Q, D]
    context_len = seq_len - query_len
    if context_len == 0:
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query row r sits at position context_len + r and sees keys at positions <= its own.
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device).tril(context_len)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    output[query_start : query_start + query_len] = out.transpose(0, 1)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, num_positions: int) -> torch.Tensor:
    """Positions [0, num_positions) of each block table: [B, num_positions, kv_heads, head_dim]."""
    gathered = cache[block_tables]  # [B, blocks, block_size, kv_heads, D]
    return gathered.flatten(1, 2)[:, :num_positions]
