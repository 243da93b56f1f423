"""Triton device functions shared by the paged attention kernels: read a tile of keys or values
through a block table, and fold one tile into an online softmax."""

import triton
import triton.language as tl


@triton.jit
def load_kv_tiles(
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    tokens,
    token_mask,
    kv_head,
    dims,
    dim_mask,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    BLOCK_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Keys and values [tokens, dims] of one KV head at positions `tokens` of one sequence, read
    through its block table; masked-off elements (past the context, padding dims) read 0."""
    block_ids = tl.load(block_table_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
    offsets = tokens % BLOCK_SIZE
    mask = token_mask[:, None] & dim_mask[None, :]
    k = tl.load(
        key_cache_ptr
        + block_ids[:, None] * stride_kc_block
        + offsets[:, None] * stride_kc_slot
        + kv_head * stride_kc_head
        + dims[None, :] * stride_kc_dim,
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        value_cache_ptr
        + block_ids[:, None] * stride_vc_block
        + offsets[:, None] * stride_vc_slot
        + kv_head * stride_vc_head
        + dims[None, :] * stride_vc_dim,
        mask=mask,
        other=0.0,
    )
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def online_softmax_step(q, k, v, visible, scale, row_max, row_sum, acc, DOT_PRECISION: tl.constexpr):
    """Add the keys/values of one tile to running (max, sum, weighted values) of each query row.

    A row's running max must be finite once any of its keys was visible; rows with no visible key in
    this tile keep their state (their terms are exp(-inf) = 0)."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    rescale = tl.exp(row_max - new_max)
    probs = tl.exp(scores - new_max[:, None])
    row_sum = row_sum * rescale + tl.sum(probs, axis=1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, row_sum, acc
