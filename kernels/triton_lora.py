"""Triton LoRA GEMMs over a batch that mixes adapters: `kernels.torch_lora.add_lora` on the GPU (or the interpreter).

Two launches per layer, both over the tiles of `LoraBatch` (at most TILE_ROWS tokens of one adapter each):
1. shrink: per (tile, block of rank columns), the tile's gathered rows of x times its slot's stacked A, written to
   those tokens' rows of h [tokens, num_parts * max_rank];
2. expand, per part of the layer: per (tile, block of the part's output rows), h's columns of the part times its
   slot's B, added into the tokens' rows of the output.
Every token is in at most one tile, so each output element is written by one program (no atomics). The grids are the
batch's tile count, which a decode graph fixes at capture (its empty tiles exit at once), so both can be captured.

Rounding follows the torch path: h and each part's product are rounded to the model dtype before the add.
"""

import torch
import triton
import triton.language as tl

from kvserve.kernels.lora import TILE_ROWS, LoraBatch, LoraStacks
from kvserve.kernels.triton_common import dot_in_fp32, dot_precision, padded

# Starting points, not yet measured on a GPU (benchmarks/gpu_check.sh is where to tune them).
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _tile(tiles_ptr, order_ptr, BLOCK_M: tl.constexpr):
    """This program's tile: its row count, adapter slot, and the tokens it holds (masked past its rows)."""
    tile = tl.program_id(0)
    num_rows = tl.load(tiles_ptr + tile * 3 + 1)
    slot = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
    row_mask = tl.arange(0, BLOCK_M) < num_rows
    tokens = tl.load(order_ptr + tl.load(tiles_ptr + tile * 3) + tl.arange(0, BLOCK_M), mask=row_mask, other=0)
    return num_rows, slot, tokens, row_mask


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, order_ptr, tiles_ptr,
    in_features, h_columns,
    stride_x, stride_a_slot, stride_a_row, stride_h,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    num_rows, slot, tokens, row_mask = _tile(tiles_ptr, order_ptr, BLOCK_M)
    if num_rows == 0:
        return
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    column_mask = offs_r < h_columns
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, in_features, BLOCK_K):
        k_mask = k + offs_k < in_features
        x = tl.load(x_ptr + tokens[:, None] * stride_x + (k + offs_k)[None, :], row_mask[:, None] & k_mask[None, :])
        a_ptrs = a_ptr + slot * stride_a_slot + offs_r[None, :] * stride_a_row + (k + offs_k)[:, None]
        a = tl.load(a_ptrs, column_mask[None, :] & k_mask[:, None])
        if DOT_FP32:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
    h_ptrs = h_ptr + tokens[:, None] * stride_h + offs_r[None, :]
    tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), row_mask[:, None] & column_mask[None, :])


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, out_ptr, order_ptr, tiles_ptr,
    h_first_column, rank, first_row, num_part_rows,
    stride_h, stride_b_slot, stride_b_row, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    num_rows, slot, tokens, row_mask = _tile(tiles_ptr, order_ptr, BLOCK_M)
    if num_rows == 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < num_part_rows
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):
        r_mask = r + offs_r < rank
        h_ptrs = h_ptr + tokens[:, None] * stride_h + h_first_column + (r + offs_r)[None, :]
        h = tl.load(h_ptrs, row_mask[:, None] & r_mask[None, :])
        b_ptrs = b_ptr + slot * stride_b_slot + (first_row + offs_n)[None, :] * stride_b_row + (r + offs_r)[:, None]
        b = tl.load(b_ptrs, n_mask[None, :] & r_mask[:, None])
        if DOT_FP32:
            h, b = h.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(h, b, acc, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + tokens[:, None] * stride_out + first_row + offs_n[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    out = tl.load(out_ptrs, mask)
    delta = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptrs, (out.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask)


def add_lora(out: torch.Tensor, x: torch.Tensor, stacks: LoraStacks, batch: LoraBatch) -> torch.Tensor:
    """`kernels.torch_lora.add_lora`: `out` plus each token's adapter's (x @ A^T) @ B^T, in place; returns `out`."""
    if not batch.num_tiles:
        return out
    a, b, rank = stacks.a, stacks.b, stacks.max_rank
    x = x.contiguous()
    h_columns = a.shape[1]
    shrunk = torch.empty(x.shape[0], h_columns, dtype=x.dtype, device=x.device)
    dot_fp32, precision = dot_in_fp32(x.dtype), dot_precision(x.dtype)
    block_r = padded(min(h_columns, 64))
    _shrink_kernel[(batch.num_tiles, triton.cdiv(h_columns, block_r))](
        x, a, shrunk, batch.token_order, batch.tiles, x.shape[1], h_columns,
        x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
        BLOCK_M=TILE_ROWS, BLOCK_R=block_r, BLOCK_K=BLOCK_K, DOT_FP32=dot_fp32, DOT_PRECISION=precision,
    )  # fmt: skip
    for part, (first_row, num_rows) in enumerate(stacks.part_rows):
        _expand_kernel[(batch.num_tiles, triton.cdiv(num_rows, BLOCK_N))](
            shrunk, b, out, batch.token_order, batch.tiles, part * rank, rank, first_row, num_rows,
            shrunk.stride(0), b.stride(0), b.stride(1), out.stride(0),
            BLOCK_M=TILE_ROWS, BLOCK_N=BLOCK_N, BLOCK_R=padded(rank), DOT_FP32=dot_fp32, DOT_PRECISION=precision,
        )  # fmt: skip
    return out
