"""Triton GEMM on group-quantized weights (kernels/group_quant.py: compressed-tensors' W8A16, W4A16, float8):
out = x @ dequantize(weight).T + bias, the weight widened tile by tile in registers, never as a whole copy.

One program computes a BLOCK_M x BLOCK_N tile of the output over a range of the input features. At decode sizes
(a few rows) the output tiles alone are too few to keep the GPU busy (a 4096-wide layer: 64 tiles for 132
multiprocessors), so the input features are split into SPLIT_K ranges, each program writes float32 partial sums
and torch adds them in order (deterministic: no atomics). Every launch setting depends only on shapes, so the
op can be captured in a CUDA graph.

A tile of BLOCK_K input features lies in one group (BLOCK_K divides the group size), so each program loads one
scale (and zero point) per output column and tile. The weight is widened as `group_quant.dequantize` widens it,
(q - zero_point) * scale rounded to the scales' dtype; with 16-bit scales equal to x's dtype the products run on
tensor cores in that dtype (exact: both operands are values of it) and accumulate in float32, otherwise in float32.
Inputs the scheme quantizes per token (W8A8, FP8_DYNAMIC) are quantized by torch first, as the reference does.
"""

import torch
import triton
import triton.language as tl

from kvserve.kernels.group_quant import GroupQuantizedWeight, quantize_activations
from kvserve.kernels.triton_common import dot_in_fp32

# Starting points, not yet measured on a GPU (benchmarks/gpu_check.sh times them against the torch path).
BLOCK_N = 64
MAX_BLOCK_K = 128
MAX_SPLIT_K = 16


def triton_takes(weight: GroupQuantizedWeight) -> bool:
    """Whether the kernel computes this weight: its groups hold whole tiles of at least 16 features (`tl.dot`'s
    least extent), which every group size of a multiple of 16 does."""
    return weight.group_size % 16 == 0


def block_k(group_size: int) -> int:
    """The largest power of two up to MAX_BLOCK_K that divides the group size."""
    return min(MAX_BLOCK_K, group_size & -group_size)


def block_m(num_rows: int) -> int:
    return 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64


def split_k(num_rows: int, out_features: int, in_features: int, group_size: int, target_programs: int) -> int:
    """Ranges of input features to split into so the grid has about `target_programs` programs."""
    tiles = triton.cdiv(num_rows, block_m(num_rows)) * triton.cdiv(out_features, BLOCK_N)
    k_blocks = in_features // block_k(group_size)
    return max(1, min(target_programs // tiles, k_blocks, MAX_SPLIT_K))


@triton.jit
def _group_gemm_kernel(
    x_ptr,
    values_ptr,
    scales_ptr,
    zero_points_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    out_features,
    in_features,
    k_per_split,
    stride_x_row,
    stride_values_row,
    stride_scales_row,
    stride_out_split,
    stride_out_row,
    NUM_BITS: tl.constexpr,
    HAS_ZERO_POINTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_TO_SCALES: tl.constexpr,
    PARTIAL: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """out[split, rows, cols] (PARTIAL: float32 partial sums of this split's features) or out[rows, cols] (+ bias,
    in out's dtype) of x [num_rows, in_features] times the widened weight's rows `cols`."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask = rows < num_rows
    col_mask = cols < out_features
    # int64 row offsets: a large layer's values pass 2**31 bytes.
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_row
    value_rows = values_ptr + cols.to(tl.int64)[None, :] * stride_values_row
    scale_rows = cols.to(tl.int64) * stride_scales_row
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(k_start, k_end, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None], other=0.0)
        # Columns past the last row load no value: whatever they hold only reaches their own outputs, never stored.
        if NUM_BITS == 4:
            # Feature 2j is byte j's low nibble, 2j + 1 its high one, each offset by 8.
            packed = tl.load(value_rows + (ks // 2)[:, None], mask=col_mask[None, :])
            q = ((packed >> ((ks % 2) * 4)[:, None].to(tl.uint8)) & 0xF).to(tl.int32) - 8
        else:
            q = tl.load(value_rows + ks[:, None], mask=col_mask[None, :])
        group = start // GROUP_SIZE
        scale = tl.load(scales_ptr + scale_rows + group, mask=col_mask, other=0.0)
        if HAS_ZERO_POINTS:
            zero_point = tl.load(zero_points_ptr + scale_rows + group, mask=col_mask, other=0)
            q = q.to(tl.int32) - zero_point.to(tl.int32)[None, :]
        w = q.to(tl.float32) * scale.to(tl.float32)[None, :]  # exact: a few bits times a 16-bit scale
        if ROUND_TO_SCALES:
            w = w.to(scales_ptr.dtype.element_ty)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if PARTIAL:
        partial = out_ptr + split * stride_out_split + rows[:, None] * stride_out_row + cols[None, :]
        tl.store(partial, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows[:, None] * stride_out_row + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def group_quantized_linear(
    x: torch.Tensor,
    weight: GroupQuantizedWeight,
    bias: torch.Tensor | None,
    target_programs: int = 1,
    splits: int | None = None,
) -> torch.Tensor:
    """`group_quant.group_quantized_linear` (the reference) for x [rows, in] on the GPU (or the interpreter):
    `splits` ranges of input features (default: enough for about `target_programs` programs)."""
    if not triton_takes(weight):
        raise ValueError(f"groups of {weight.group_size} features: the Triton kernel takes multiples of 16")
    inputs = x if weight.activations is None else quantize_activations(x.float(), weight.activations)
    inputs = inputs.contiguous()
    num_rows, in_features, out_features = inputs.shape[0], weight.in_features, weight.out_features
    tile_k = block_k(weight.group_size)
    if splits is None:
        splits = split_k(num_rows, out_features, in_features, weight.group_size, target_programs)
    k_blocks = in_features // tile_k
    k_per_split = triton.cdiv(k_blocks, splits) * tile_k
    splits = triton.cdiv(in_features, k_per_split)  # no empty range
    # Zero points are read with the scales' row stride.
    scales = weight.scales.contiguous()
    zero_points = scales if weight.zero_points is None else weight.zero_points.contiguous()  # never read if None
    scales_dtype = scales.dtype
    tensor_cores = scales_dtype == inputs.dtype and scales_dtype != torch.float32 and not dot_in_fp32(inputs.dtype)
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    partial = splits > 1
    target = torch.empty(splits, num_rows, out_features, dtype=torch.float32, device=x.device) if partial else out
    tile_m = block_m(num_rows)
    grid = (triton.cdiv(num_rows, tile_m), triton.cdiv(out_features, BLOCK_N), splits)
    _group_gemm_kernel[grid](
        inputs,
        weight.values,
        scales,
        zero_points,
        out if bias is None else bias,  # never read without a bias
        target,
        num_rows,
        out_features,
        in_features,
        k_per_split,
        inputs.stride(0),
        weight.values.stride(0),
        scales.stride(0),
        target.stride(0) if partial else 0,
        target.stride(-2),
        NUM_BITS=weight.num_bits,
        HAS_ZERO_POINTS=weight.zero_points is not None,
        HAS_BIAS=bias is not None,
        ROUND_TO_SCALES=scales_dtype != torch.float32,
        PARTIAL=partial,
        GROUP_SIZE=weight.group_size,
        BLOCK_M=tile_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=tile_k,
        DOT_FP32=not tensor_cores,
    )
    if not partial:
        return out
    summed = target.sum(dim=0)
    if bias is not None:
        summed += bias.float()
    return out.copy_(summed)
