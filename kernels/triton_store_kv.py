"""Triton KV store: writes one step's new keys and values into their paged-cache slots.

Reference: `kernels.torch_paged_attention.store_kv`.
"""

import torch
import triton
import triton.language as tl

from kernels.triton_common import padded


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
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
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding tokens have no slot
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    key_src = key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :] * stride_key_dim
    key_dst = (
        key_cache_ptr
        + block * stride_kc_block
        + offset * stride_kc_slot
        + heads[:, None] * stride_kc_head
        + dims[None, :] * stride_kc_dim
    )
    tl.store(key_dst, tl.load(key_src, mask=mask).to(key_cache_ptr.dtype.element_ty), mask=mask)

    value_src = (
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :] * stride_value_dim
    )
    value_dst = (
        value_cache_ptr
        + block * stride_vc_block
        + offset * stride_vc_slot
        + heads[:, None] * stride_vc_head
        + dims[None, :] * stride_vc_dim
    )
    tl.store(value_dst, tl.load(value_src, mask=mask).to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the cache slots; slots < 0 are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=padded(head_dim, minimum=1),
        BLOCK_SIZE=key_cache.shape[1],
    )
