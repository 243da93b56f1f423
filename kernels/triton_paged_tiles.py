"""Triton device functions shared by the paged attention kernels: read a tile of keys and values
(and their int8 scales) through a block table, soft-cap scores, and fold one tile into an online softmax."""

import triton
import triton.language as tl


@triton.jit
def load_kv_tiles(
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
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
    stride_ks_block,
    stride_ks_slot,
    stride_ks_head,
    stride_vs_block,
    stride_vs_slot,
    stride_vs_head,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Keys and values [tokens, dims] of one KV head at positions `tokens` of one sequence, read
    through its block table (masked-off elements read 0), and for an int8 cache their scales
    [tokens] (1 otherwise)."""
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
    if QUANTIZED:
        k_scale = tl.load(
            key_scale_ptr + block_ids * stride_ks_block + offsets * stride_ks_slot + kv_head * stride_ks_head,
            mask=token_mask,
            other=0.0,
        )
        v_scale = tl.load(
            value_scale_ptr + block_ids * stride_vs_block + offsets * stride_vs_slot + kv_head * stride_vs_head,
            mask=token_mask,
            other=0.0,
        )
    else:
        k_scale = tl.full(tokens.shape, 1.0, tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def soft_cap(scores, LOGIT_SOFTCAP: tl.constexpr):
    """LOGIT_SOFTCAP * tanh(scores / LOGIT_SOFTCAP). Not every Triton has tanh, so it is computed as
    tanh(x) = sign(x) * (1 - e) / (1 + e) with e = exp(-2|x|): the exponent is never positive, so no score,
    however large, overflows (e is then 0 and tanh +-1); its error is a few fp32 roundings of LOGIT_SOFTCAP."""
    e = tl.exp(tl.abs(scores) * (-2.0 / LOGIT_SOFTCAP))
    magnitude = (LOGIT_SOFTCAP * (1.0 - e)) / (1.0 + e)
    return tl.where(scores < 0, -magnitude, magnitude)


@triton.jit
def online_softmax_step(
    q,
    k,
    v,
    k_scale,
    v_scale,
    visible,
    scale,
    row_max,
    row_sum,
    acc,
    QUANTIZED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOGIT_SOFTCAP: tl.constexpr,
    ROWS_MAY_SEE_NOTHING: tl.constexpr,
):
    """Add one tile of keys/values to the running (max, sum, weighted values) of each query row.

    K and V are multiplied in q's dtype (int8 converts exactly to 16-bit floats); an int8 cache's K
    scales multiply the scores and its V scales the probabilities, so no tile is dequantized. A
    positive LOGIT_SOFTCAP soft-caps the scaled scores before the mask. Rows with no visible key in
    this tile keep their state (their terms are exp(-inf) = 0) once they have a finite max; where a
    row can meet a tile before its first visible key (sliding windows), ROWS_MAY_SEE_NOTHING makes
    such a row subtract 0 instead of its max of -inf, which would give exp(-inf + inf) = NaN."""
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale
    if QUANTIZED:
        scores = scores * k_scale[None, :]
    if LOGIT_SOFTCAP > 0:
        scores = soft_cap(scores, LOGIT_SOFTCAP)
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max) if ROWS_MAY_SEE_NOTHING else new_max
    rescale = tl.exp(row_max - shift)
    probs = tl.exp(scores - shift[:, None])
    row_sum = row_sum * rescale + tl.sum(probs, axis=1)
    if QUANTIZED:
        probs = probs * v_scale[None, :]
    acc = acc * rescale[:, None] + tl.dot(probs.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return new_max, row_sum, acc
