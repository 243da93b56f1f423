"""Triton versions of the fused layer ops: RMSNorm (optionally after a residual add, both results
written in place), SiLU-and-mul of a packed gate/up output, and rotary embeddings applied in place
to query and key. Each is one launch that reads its inputs once, where torch takes five to ten.

Rounding follows the references in `kernels.torch_layer_ops` (HF's): sums and norms in fp32, the
normalised value rounded to the model dtype before the weight multiplies it, the activation rounded
before `up` multiplies it. Rotary embeddings are computed in fp32 and rounded once, where HF's 16-bit
path rounds after each product.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    rows_per_group,
    stride_x_group,
    stride_x_row,
    stride_r_row,
    stride_out_row,
    eps,
    SIZE: tl.constexpr,
    SIZE_PAD: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    """One row: rows are grouped (a token's heads for a per-head norm), so x may be a strided view."""
    row = tl.program_id(0).to(tl.int64)  # row x stride passes 2^31 elements in a long prefill
    x_offset = (row // rows_per_group) * stride_x_group + (row % rows_per_group) * stride_x_row
    cols = tl.arange(0, SIZE_PAD)
    mask = cols < SIZE
    x = tl.load(x_ptr + x_offset + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r_row + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r_row + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / SIZE + eps)
    normed = (x32 * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, size, stride_x_row, stride_out_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # 2^31 elements are 150k tokens of a 14336-wide gate/up
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + size + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    x_ptr, heads, num_heads, stride_head, cos_first, cos_second, sin_first, sin_second, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):  # fmt: skip
    """Rotate one token's `heads` (a tile; those >= num_heads are masked off) in place:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    cols = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < HALF)
    first_ptr = x_ptr + heads[:, None] * stride_head + cols[None, :]
    first = tl.load(first_ptr, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(first_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    rotated_first = first * cos_first[None, :] - second * sin_first[None, :]
    rotated_second = second * cos_second[None, :] + first * sin_second[None, :]
    tl.store(first_ptr, rotated_first.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first_ptr + HALF, rotated_second.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    cos_ptr,
    sin_ptr,
    num_query_heads,
    num_key_heads,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_table,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_TILE: tl.constexpr,
):
    """One (token, tile of heads) program: the tile's query heads and the key heads of the same numbers (a token
    has no more key heads than query heads), all in one round trip rather than a loop over the heads."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_TILE + tl.arange(0, HEADS_TILE)
    position = tl.load(positions_ptr + token)
    cols = tl.arange(0, HALF_PAD)
    mask = cols < HALF
    table = position * stride_table + cols
    cos_first = tl.load(cos_ptr + table, mask=mask, other=0.0)
    cos_second = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0)
    sin_first = tl.load(sin_ptr + table, mask=mask, other=0.0)
    sin_second = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0)
    _rotate_heads(
        query_ptr + token * stride_q_token, heads, num_query_heads, stride_q_head, cos_first, cos_second, sin_first,
        sin_second, HALF, HALF_PAD,
    )  # fmt: skip
    _rotate_heads(
        key_ptr + token * stride_k_token, heads, num_key_heads, stride_k_head, cos_first, cos_second, sin_first,
        sin_second, HALF, HALF_PAD,
    )  # fmt: skip


def row_warps(row_elements: int) -> int:
    """Warps for a program that reduces or maps one row: about 8 elements a thread, 1 to 8 warps (a 4096-wide
    norm gets 8, a 64-wide head 1). A starting point: benchmarks/gpu_kernel_bench.py is where to check it."""
    return max(1, min(8, row_elements // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [rows, size], or of each head of x [tokens, heads, size] (any strides)."""
    size = x.shape[-1]
    grouped = x if x.dim() == 3 else x[:, None]
    num_groups, rows_per_group = grouped.shape[:2]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        _rms_norm_kernel[(num_groups * rows_per_group,)](
            grouped, out, weight, out, rows_per_group, grouped.stride(0), grouped.stride(1), 0, size, eps,
            SIZE=size, SIZE_PAD=triton.next_power_of_2(size), ADD_RESIDUAL=False, num_warps=row_warps(size),
        )  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), written into x and residual [rows, size] in place."""
    num_rows, size = x.shape
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x, residual, weight, x, 1, x.stride(0), 0, residual.stride(0), x.stride(0), eps,
            SIZE=size, SIZE_PAD=triton.next_power_of_2(size), ADD_RESIDUAL=True, num_warps=row_warps(size),
        )  # fmt: skip
    return x, residual


SILU_BLOCK = 1024
ROTARY_HEADS_TILE = 8


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :n]) * x[:, n:] for the packed gate/up output x [rows, 2n]."""
    num_rows, size = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, size, dtype=x.dtype, device=x.device)
    if num_rows:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(size, SILU_BLOCK))](
            x, out, size, x.stride(0), out.stride(0), BLOCK=SILU_BLOCK, num_warps=row_warps(SILU_BLOCK)
        )
    return out


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [tokens, heads, D] and key [tokens, kv_heads, D] (heads contiguous rows) in place."""
    num_tokens, num_query_heads, head_dim = query.shape
    if key.shape[1] > num_query_heads:
        raise ValueError(f"{key.shape[1]} key heads but {num_query_heads} query heads: tiles cover the query's")
    if num_tokens:
        # Tiles of up to 8 heads: a decode batch of 1 still spreads a 32-head model over 4 programs.
        heads_tile = min(ROTARY_HEADS_TILE, triton.next_power_of_2(num_query_heads))
        _rotary_kernel[(num_tokens, triton.cdiv(num_query_heads, heads_tile))](
            positions, query, key, cos, sin, num_query_heads, key.shape[1], query.stride(0), query.stride(1),
            key.stride(0), key.stride(1), cos.stride(0), HALF=head_dim // 2,
            HALF_PAD=triton.next_power_of_2(head_dim // 2), HEADS_TILE=heads_tile,
            num_warps=row_warps(heads_tile * head_dim),
        )  # fmt: skip
    return query, key
