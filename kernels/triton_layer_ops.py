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
    row = tl.program_id(0)
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
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + size + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    x_ptr, num_heads, stride_head, cos_first, cos_second, sin_first, sin_second, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):  # fmt: skip
    """Rotate heads [0, num_heads) of one token in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    cols = tl.arange(0, HALF_PAD)
    mask = cols < HALF
    for head in range(num_heads):
        first_ptr = x_ptr + head * stride_head + cols
        first = tl.load(first_ptr, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(first_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(first_ptr, (first * cos_first - second * sin_first).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(first_ptr + HALF, (second * cos_second + first * sin_second).to(x_ptr.dtype.element_ty), mask=mask)


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
):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    cols = tl.arange(0, HALF_PAD)
    mask = cols < HALF
    table = position * stride_table + cols
    cos_first = tl.load(cos_ptr + table, mask=mask, other=0.0)
    cos_second = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0)
    sin_first = tl.load(sin_ptr + table, mask=mask, other=0.0)
    sin_second = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0)
    _rotate_heads(
        query_ptr + token * stride_q_token, num_query_heads, stride_q_head, cos_first, cos_second, sin_first,
        sin_second, HALF, HALF_PAD,
    )  # fmt: skip
    _rotate_heads(
        key_ptr + token * stride_k_token, num_key_heads, stride_k_head, cos_first, cos_second, sin_first,
        sin_second, HALF, HALF_PAD,
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [rows, size], or of each head of x [tokens, heads, size] (any strides)."""
    size = x.shape[-1]
    grouped = x if x.dim() == 3 else x[:, None]
    num_groups, rows_per_group = grouped.shape[:2]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        _rms_norm_kernel[(num_groups * rows_per_group,)](
            grouped, out, weight, out, rows_per_group, grouped.stride(0), grouped.stride(1), 0, size, eps,
            SIZE=size, SIZE_PAD=triton.next_power_of_2(size), ADD_RESIDUAL=False,
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
            SIZE=size, SIZE_PAD=triton.next_power_of_2(size), ADD_RESIDUAL=True,
        )  # fmt: skip
    return x, residual


SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :n]) * x[:, n:] for the packed gate/up output x [rows, 2n]."""
    num_rows, size = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, size, dtype=x.dtype, device=x.device)
    if num_rows:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(size, SILU_BLOCK))](
            x, out, size, x.stride(0), out.stride(0), BLOCK=SILU_BLOCK
        )
    return out


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [tokens, heads, D] and key [tokens, kv_heads, D] (heads contiguous rows) in place."""
    num_tokens, num_query_heads, head_dim = query.shape
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, query, key, cos, sin, num_query_heads, key.shape[1], query.stride(0), query.stride(1),
            key.stride(0), key.stride(1), cos.stride(0), HALF=head_dim // 2,
            HALF_PAD=triton.next_power_of_2(head_dim // 2),
        )  # fmt: skip
    return query, key
