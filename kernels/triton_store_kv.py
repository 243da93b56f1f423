"""Triton KV store: writes one step's new keys and values into their paged-cache slots, quantizing
them to int8 with one scale per token and head when the cache is int8.

Reference: `kernels.torch_paged_attention.store_kv`.
"""

import torch
import triton
import triton.language as tl

from kvserve.kernels.paged_kv import INT8_MAX, PagedKV
from kvserve.kernels.triton_common import padded, scale_args


@triton.jit
def _store_heads(
    src_ptr,
    dst_ptr,
    scale_dst_ptr,
    heads,
    head_mask,
    dims,
    mask,
    stride_src_head,
    stride_src_dim,
    stride_dst_head,
    stride_dst_dim,
    stride_scale_head,
    QUANTIZED: tl.constexpr,
    INT8_LIMIT: tl.constexpr,
):
    """Copy one token's [heads, dims] from src to its slot, or store it as int8 plus per-head scales."""
    x = tl.load(src_ptr + heads[:, None] * stride_src_head + dims[None, :] * stride_src_dim, mask=mask, other=0.0)
    dst = dst_ptr + heads[:, None] * stride_dst_head + dims[None, :] * stride_dst_dim
    if QUANTIZED:
        x = x.to(tl.float32)
        # IEEE-rounded divisions (div_rn), as torch's: Triton compiles `/` on fp32 to an approximate division
        # (div.full.f32, within 2 ulps), which moves a quotient near .5 to the other code.
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), INT8_LIMIT * 1.0)
        scaled = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])  # an all-zero vector: zeros, scale 0
        rounded = tl.where(scaled >= 0, tl.floor(scaled + 0.5), -tl.floor(0.5 - scaled))  # halves away from zero
        tl.store(dst, tl.minimum(tl.maximum(rounded, -INT8_LIMIT), INT8_LIMIT).to(tl.int8), mask=mask)
        tl.store(scale_dst_ptr + heads * stride_scale_head, scale, mask=head_mask)
    else:
        tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_key_dim,
    stride_value_token,
    stride_value_head,
    stride_value_dim,
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
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
    INT8_LIMIT: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding tokens have no slot
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    head_mask = heads < NUM_KV_HEADS
    mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
    _store_heads(
        key_ptr + token * stride_key_token,
        key_cache_ptr + block * stride_kc_block + offset * stride_kc_slot,
        key_scale_ptr + block * stride_ks_block + offset * stride_ks_slot,
        heads, head_mask, dims, mask, stride_key_head, stride_key_dim, stride_kc_head, stride_kc_dim,
        stride_ks_head, QUANTIZED, INT8_LIMIT,
    )  # fmt: skip
    _store_heads(
        value_ptr + token * stride_value_token,
        value_cache_ptr + block * stride_vc_block + offset * stride_vc_slot,
        value_scale_ptr + block * stride_vs_block + offset * stride_vs_slot,
        heads, head_mask, dims, mask, stride_value_head, stride_value_dim, stride_vc_head, stride_vc_dim,
        stride_vs_head, QUANTIZED, INT8_LIMIT,
    )  # fmt: skip


def store_kv(key: torch.Tensor, value: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the cache slots; slots < 0 are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key_scale, value_scale, key_scale_strides, value_scale_strides = scale_args(cache)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        cache.key,
        cache.value,
        key_scale,
        value_scale,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *cache.key.stride(),
        *cache.value.stride(),
        *key_scale_strides,
        *value_scale_strides,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=padded(head_dim, minimum=1),
        BLOCK_SIZE=cache.block_size,
        QUANTIZED=cache.quantized,
        INT8_LIMIT=INT8_MAX,
    )
