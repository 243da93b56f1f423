"""Triton paged prefill/extend attention: variable-length query runs against their paged context.

The new tokens of several sequences are packed along one axis (`query_start_loc`). A sequence's new
tokens sit at the end of its context, so query row r of a sequence with `query_len` new tokens and
`seq_len` positions is position `seq_len - query_len + r` and sees keys at positions <= its own:
the cached prefix (prefix caching, earlier chunks of a chunked prefill) and the causal part of the
new tokens, which the KV store has already written to the cache. One program computes a tile of
query rows of one head with an online softmax over key tiles read through the block table.

With a sliding window W a row at position i sees only keys at positions after i - W. A program's key loop
starts at its first row's window start (the earliest position any of its rows sees), so no position before
that is read; later rows mask the positions before their own window start.

Reference: `kernels.torch_paged_attention.paged_attention`.
"""

import torch
import triton
import triton.language as tl

from kvserve.kernels.paged_kv import PagedKV
from kvserve.kernels.triton_common import attention_options, dot_in_fp32, dot_precision, padded, scale_args
from kvserve.kernels.triton_paged_tiles import load_kv_tiles, online_softmax_step


@triton.jit(do_not_specialize=["first_seq"])  # it changes every step: one compiled variant for all
def _extend_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    first_seq,
    scale,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
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
    stride_o_token,
    stride_o_head,
    stride_o_dim,
    stride_bt_seq,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    LOGIT_SOFTCAP: tl.constexpr,
):
    seq = first_seq + tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if tile * BLOCK_M >= query_len:  # the grid covers the longest query run
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    kv_head = head // GROUP_SIZE

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    positions = context_len + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        query_ptr
        + (query_start + rows)[:, None] * stride_q_token
        + head * stride_q_head
        + dims[None, :] * stride_q_dim,
        mask=q_mask,
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    # Without a window every row sees position 0, so each row's running max is finite after the first key
    # tile; with one, a later row may see nothing in the first tiles (online_softmax_step guards that).
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    kv_end = tl.minimum(context_len + (tile + 1) * BLOCK_M, seq_len)  # one past the tile's last position
    # With a window the tile's first row sees the earliest position: its window start.
    kv_start = tl.maximum(context_len + tile * BLOCK_M - SLIDING_WINDOW + 1, 0) if SLIDING_WINDOW > 0 else 0
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < kv_end
        k, v, k_scale, v_scale = load_kv_tiles(
            key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr, block_tables_ptr + seq * stride_bt_seq,
            tokens, token_mask, kv_head, dims, dim_mask, stride_kc_block, stride_kc_slot, stride_kc_head,
            stride_kc_dim, stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim, stride_ks_block,
            stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head, BLOCK_SIZE, QUANTIZED,
        )  # fmt: skip
        visible = token_mask[None, :] & (tokens[None, :] <= positions[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (tokens[None, :] > positions[:, None] - SLIDING_WINDOW)
        row_max, row_sum, acc = online_softmax_step(
            q, k, v, k_scale, v_scale, visible, scale, row_max, row_sum, acc, QUANTIZED, DOT_PRECISION,
            LOGIT_SOFTCAP, SLIDING_WINDOW > 0,
        )  # fmt: skip

    out = acc / row_sum[:, None]
    tl.store(
        out_ptr + (query_start + rows)[:, None] * stride_o_token + head * stride_o_head + dims[None, :] * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def paged_extend_attention(
    query: torch.Tensor,
    cache: PagedKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    out: torch.Tensor,
    block_m: int = 64,
    block_n: int = 64,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> None:
    """Causal attention of the packed query rows [num_tokens, num_heads, head_dim] of sequences
    `first_seq .. first_seq + num_seqs - 1` over their paged contexts, written to the same rows of out;
    a row at position i sees only keys after i - `sliding_window` if given; scores soft-capped at `logit_softcap`
    if given."""
    if num_seqs == 0:
        return
    options = attention_options(sliding_window, logit_softcap)
    num_heads, head_dim = query.shape[1:]
    group_size = num_heads // cache.num_kv_heads
    key_scale, value_scale, key_scale_strides, value_scale_strides = scale_args(cache)
    _extend_kernel[(num_seqs, num_heads, triton.cdiv(max_query_len, block_m))](
        query,
        cache.key,
        cache.value,
        key_scale,
        value_scale,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        first_seq,
        scale,
        *query.stride(),
        *cache.key.stride(),
        *cache.value.stride(),
        *key_scale_strides,
        *value_scale_strides,
        *out.stride(),
        block_tables.stride(0),
        GROUP_SIZE=group_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=padded(head_dim),
        BLOCK_SIZE=cache.block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_FP32=dot_in_fp32(query.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
        QUANTIZED=cache.quantized,
        **options,
    )
