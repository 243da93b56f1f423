"""Triton paged decode attention: one query token per sequence against its paged context.

Two kernels. The first splits each sequence's context into `num_segments` segments and computes,
per (sequence, KV head, segment), the softmax-weighted values of that segment and their
log-sum-exp; the query heads that share a KV head are packed into the rows of one program, so each
key and value is read from memory once per group. The second merges a sequence's segments by their
log-sum-exp. Splitting gives a small batch enough programs to keep the GPU busy; the partial buffers
are allocated once (`DecodeWorkspace`), so launches need no allocation. A large batch needs no split:
with one segment the first kernel writes the output itself and the merge is not launched.

With a sliding window W the query (position seq_len - 1) sees positions seq_len - W ... seq_len - 1:
the segments split that range only, so no position before it is read and a segment's work scales with
W, not with seq_len. Soft-capping applies to the scores tile by tile (`online_softmax_step`).

Reference: the query-length-1 case of `kernels.torch_paged_attention.paged_attention`.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels.paged_kv import PagedKV
from kvserve.kernels.triton_common import attention_options, dot_in_fp32, dot_precision, padded, scale_args
from kvserve.kernels.triton_paged_tiles import load_kv_tiles, online_softmax_step


@triton.jit
def _decode_segment_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
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
    stride_bt_seq,
    stride_po_seq,
    stride_po_head,
    stride_po_segment,
    stride_pl_seq,
    stride_pl_head,
    out_ptr,
    stride_o_token,
    stride_o_head,
    stride_o_dim,
    GROUP_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    LOGIT_SOFTCAP: tl.constexpr,
    SINGLE_SEGMENT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    num_segments = tl.num_programs(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Whole tiles per segment; trailing segments of a short sequence (or a short window) are empty.
    if SLIDING_WINDOW > 0:
        first_visible = tl.maximum(seq_len - SLIDING_WINDOW, 0)
        segment_len = tl.cdiv(tl.cdiv(seq_len - first_visible, num_segments), BLOCK_N) * BLOCK_N
        start = first_visible + segment * segment_len
    else:
        segment_len = tl.cdiv(tl.cdiv(seq_len, num_segments), BLOCK_N) * BLOCK_N
        start = segment * segment_len
    end = tl.minimum(start + segment_len, seq_len)

    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP_SIZE + group
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_mask = (group[:, None] < GROUP_SIZE) & dim_mask[None, :]
    q = tl.load(
        query_ptr + seq * stride_q_token + heads[:, None] * stride_q_head + dims[None, :] * stride_q_dim,
        mask=q_mask,
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        k, v, k_scale, v_scale = load_kv_tiles(
            key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr, block_tables_ptr + seq * stride_bt_seq,
            tokens, token_mask, kv_head, dims, dim_mask, stride_kc_block, stride_kc_slot, stride_kc_head,
            stride_kc_dim, stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim, stride_ks_block,
            stride_ks_slot, stride_ks_head, stride_vs_block, stride_vs_slot, stride_vs_head, BLOCK_SIZE, QUANTIZED,
        )  # fmt: skip
        visible = token_mask[None, :]
        # Every loaded position is visible to the one query row, so its max is finite from the first tile on.
        row_max, row_sum, acc = online_softmax_step(
            q, k, v, k_scale, v_scale, visible, scale, row_max, row_sum, acc, QUANTIZED, DOT_PRECISION,
            LOGIT_SOFTCAP, False,
        )  # fmt: skip

    # A non-empty segment's sum is >= 1 (its max term is exp(0)); an empty one's is 0, and the floor
    # turns it into zeros here and log-sum-exp -inf, a weight of 0 in the merge.
    row_sum = tl.maximum(row_sum, 1.0)
    out = acc / row_sum[:, None]
    if SINGLE_SEGMENT:  # the whole context: this is the output, and there is nothing to merge
        out_ptrs = out_ptr + seq * stride_o_token + heads[:, None] * stride_o_head + dims[None, :] * stride_o_dim
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
        return
    lse = row_max + tl.log(row_sum)
    out_ptrs = (
        partial_out_ptr
        + seq * stride_po_seq
        + heads[:, None] * stride_po_head
        + segment * stride_po_segment
        + dims[None, :]
    )
    tl.store(out_ptrs, out, mask=q_mask)
    head_mask = group < GROUP_SIZE
    tl.store(partial_lse_ptr + seq * stride_pl_seq + heads * stride_pl_head + segment, lse, mask=head_mask)


@triton.jit(do_not_specialize=["num_segments"])
def _merge_segments_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_segments,
    stride_po_seq,
    stride_po_head,
    stride_po_segment,
    stride_pl_seq,
    stride_pl_head,
    stride_o_token,
    stride_o_head,
    stride_o_dim,
    SEGMENTS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    segments = tl.arange(0, SEGMENTS_PAD)
    segment_mask = segments < num_segments
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM

    lse = tl.load(
        partial_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + segments, mask=segment_mask, other=float("-inf")
    )
    weights = tl.exp(lse - tl.max(lse, axis=0))  # segment 0 is never empty, so the max is finite
    partial = tl.load(
        partial_out_ptr
        + seq * stride_po_seq
        + head * stride_po_head
        + segments[:, None] * stride_po_segment
        + dims[None, :],
        mask=segment_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.sum(weights, axis=0)
    tl.store(
        out_ptr + seq * stride_o_token + head * stride_o_head + dims * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@dataclass(frozen=True)
class DecodeWorkspace:
    """fp32 partial results of every (sequence, query head, segment), allocated once."""

    partial_out: torch.Tensor  # [max_num_seqs, num_heads, max_segments, head_dim]
    partial_lse: torch.Tensor  # [max_num_seqs, num_heads, max_segments]

    @classmethod
    def allocate(
        cls, max_num_seqs: int, num_heads: int, head_dim: int, max_segments: int, device: torch.device
    ) -> "DecodeWorkspace":
        shape = (max_num_seqs, num_heads, max_segments)
        return cls(
            partial_out=torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
            partial_lse=torch.empty(shape, dtype=torch.float32, device=device),
        )

    @property
    def max_num_seqs(self) -> int:
        return self.partial_out.shape[0]

    @property
    def max_segments(self) -> int:
        return self.partial_out.shape[2]


def paged_decode_attention(
    query: torch.Tensor,
    cache: PagedKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_segments: int,
    workspace: DecodeWorkspace,
    out: torch.Tensor,
    block_n: int = 64,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> None:
    """out[i] = attention of query[i] ([num_seqs, num_heads, head_dim]) over keys/values of positions
    [0, seq_lens[i]) of sequence i (the last `sliding_window` of them if given), read through block_tables[i];
    scores soft-capped at `logit_softcap` if given."""
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return
    num_kv_heads = cache.num_kv_heads
    group_size = num_heads // num_kv_heads
    if num_seqs > workspace.max_num_seqs or not 1 <= num_segments <= workspace.max_segments:
        raise ValueError(
            f"{num_seqs} sequences x {num_segments} segments exceed the workspace "
            f"({workspace.max_num_seqs} x {workspace.max_segments})"
        )
    head_dim_pad = padded(head_dim)
    options = attention_options(sliding_window, logit_softcap)
    key_scale, value_scale, key_scale_strides, value_scale_strides = scale_args(cache)
    partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
    _decode_segment_kernel[(num_seqs, num_kv_heads, num_segments)](
        query,
        cache.key,
        cache.value,
        key_scale,
        value_scale,
        block_tables,
        seq_lens,
        partial_out,
        partial_lse,
        scale,
        *query.stride(),
        *cache.key.stride(),
        *cache.value.stride(),
        *key_scale_strides,
        *value_scale_strides,
        block_tables.stride(0),
        *partial_out.stride()[:3],
        *partial_lse.stride()[:2],
        out,
        *out.stride(),
        GROUP_SIZE=group_size,
        GROUP_PAD=padded(group_size),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=cache.block_size,
        BLOCK_N=block_n,
        DOT_FP32=dot_in_fp32(query.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
        QUANTIZED=cache.quantized,
        SINGLE_SEGMENT=num_segments == 1,
        **options,
    )
    if num_segments == 1:
        return
    _merge_segments_kernel[(num_seqs, num_heads)](
        partial_out,
        partial_lse,
        out,
        num_segments,
        *partial_out.stride()[:3],
        *partial_lse.stride()[:2],
        *out.stride(),
        SEGMENTS_PAD=triton.next_power_of_2(workspace.max_segments),  # one compiled variant for any count
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
    )
