"""Triton fused mixture-of-experts: each token through its top-k experts' SwiGLU MLPs, weighted and summed.

The num_tokens * top_k (token, k) assignments, numbered row = token * top_k + k, are sorted by expert
and each expert's run is padded to a multiple of BLOCK_M (`align_by_expert`), so a block of BLOCK_M
sorted rows belongs to one expert. Three launches follow:
1. gate/up: one program per (block, tile of intermediate columns) multiplies the block's gathered
   hidden rows by its expert's gate and up rows in one pass over hidden, applies SiLU-and-mul and
   writes the activations of those assignment rows;
2. down: the same grid over hidden columns multiplies the activations by the expert's down weight
   and writes each assignment row's expert output;
3. combine: per token, the top-k expert outputs times their routing weights, summed in order in fp32.
Every row of the intermediates is written by exactly one program and the sum over top-k happens in one
place, so results are deterministic (no atomics).

The prep step is torch ops with no device-to-host read, and the grids depend only on shapes (blocks
past the last expert's run exit at once), so the whole op can be captured in a CUDA graph.

Rounding follows `kernels.torch_moe.fused_moe` (HF's): products accumulate in fp32; gate and up, the
activation, its product with up and the expert output are rounded to the model dtype where torch
rounds them; routing weights and the top-k sum stay in fp32 until the single final rounding.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_common import dot_in_fp32, dot_precision, padded

# Starting points, not yet measured on a GPU (benchmarks/gpu_check.sh is where to tune them).
MAX_BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
COMBINE_BLOCK = 1024


@dataclass(frozen=True)
class ExpertBlocks:
    """Assignment rows grouped by expert in blocks of `block_m` rows, each block of one expert."""

    sorted_rows: torch.Tensor  # [num_blocks * block_m] int32; padding holds num_rows (masked off)
    block_experts: torch.Tensor  # [num_blocks] int32; num_experts for the blocks past the last run
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_experts.numel()


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort the assignments [num_tokens, top_k] by expert and pad each expert's run to whole blocks.

    The number of blocks is an upper bound known from the shapes (every picked expert wastes at most
    block_m - 1 rows), so nothing here waits for the device."""
    flat_ids = topk_ids.flatten().long()  # scatter_add_ takes int64 indices only
    num_rows = flat_ids.numel()
    device = flat_ids.device
    sorted_experts, order = flat_ids.sort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # bincount would read the max back to the host
    run_starts = counts.cumsum(0) - counts
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    rank_in_run = torch.arange(num_rows, device=device) - run_starts[sorted_experts]
    destinations = padded_ends[sorted_experts] - padded_counts[sorted_experts] + rank_in_run
    num_blocks = triton.cdiv(num_rows + min(num_experts, num_rows) * (block_m - 1), block_m)
    sorted_rows = torch.full((num_blocks * block_m,), num_rows, dtype=torch.int32, device=device)
    sorted_rows[destinations] = order.to(torch.int32)
    # Block b belongs to the first expert whose padded run ends past it; an empty run ends where the
    # previous one does, so it never owns a block.
    block_ids = torch.arange(num_blocks, device=device)
    block_experts = torch.searchsorted(padded_ends // block_m, block_ids, right=True).to(torch.int32)
    return ExpertBlocks(sorted_rows, block_experts, block_m)


@triton.jit
def _expert_matmul_kernel(
    input_ptr,
    weight_ptr,
    out_ptr,
    sorted_rows_ptr,
    block_experts_ptr,
    num_experts,
    num_rows,
    in_size,
    out_size,
    stride_in_row,
    stride_in_col,
    stride_w_expert,
    stride_w_row,
    stride_w_col,
    stride_out_row,
    INPUTS_PER_ROW: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[row, n] = input[row // INPUTS_PER_ROW] . weight[expert, n] for the block's rows and a tile
    of n; GATED: silu(gate) * up, with the up row `out_size` rows below its gate row."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:  # past the last expert's run
        return
    # int64 offsets: num_tokens * top_k * size, and all experts' weights together, can pass 2**31.
    rows = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < num_rows
    input_rows = input_ptr + (rows // INPUTS_PER_ROW)[:, None] * stride_in_row
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_size
    gate_rows = weight_ptr + expert.to(tl.int64) * stride_w_expert + cols[None, :] * stride_w_row
    up_rows = gate_rows + out_size * stride_w_row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, in_size, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < in_size
        x = tl.load(input_rows + ks[None, :] * stride_in_col, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(gate_rows + ks[:, None] * stride_w_col, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(up_rows + ks[:, None] * stride_w_col, mask=w_mask, other=0.0)
            if DOT_FP32:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(x, w_up, acc_up, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    tl.store(
        out_ptr + rows[:, None] * stride_out_row + cols[None, :],
        acc.to(dtype),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _combine_kernel(
    expert_out_ptr,
    topk_weights_ptr,
    out_ptr,
    hidden_size,
    stride_e_row,
    stride_tw_token,
    stride_tw_slot,
    stride_out_token,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden_size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):  # in slot order, as torch sums over top-k
        weight = tl.load(topk_weights_ptr + token * stride_tw_token + slot * stride_tw_slot).to(tl.float32)
        row = (token * TOP_K + slot).to(tl.int64)  # rows * hidden_size can pass 2**31
        acc += weight * tl.load(expert_out_ptr + row * stride_e_row + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out_token + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_m_for(num_rows: int, num_experts: int) -> int:
    """Rows per block: about the mean rows per expert, so decode steps do not pad each expert to 64."""
    return min(MAX_BLOCK_M, padded(triton.cdiv(num_rows, num_experts)))


def _expert_matmul(
    inputs: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    blocks: ExpertBlocks,
    inputs_per_row: int,
    gated: bool,
) -> None:
    num_experts, _, in_size = weight.shape
    out_size = out.shape[1]
    block_n = min(BLOCK_N, padded(out_size))
    _expert_matmul_kernel[(blocks.num_blocks, triton.cdiv(out_size, block_n))](
        inputs, weight, out, blocks.sorted_rows, blocks.block_experts, num_experts, out.shape[0], in_size,
        out_size, *inputs.stride(), *weight.stride(), out.stride(0), INPUTS_PER_ROW=inputs_per_row, GATED=gated,
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=min(BLOCK_K, padded(in_size)),
        DOT_FP32=dot_in_fp32(inputs.dtype), DOT_PRECISION=dot_precision(inputs.dtype),
    )  # fmt: skip


def fused_moe(
    hidden: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) for hidden [num_tokens, hidden_size].

    Reference: `kernels.torch_moe.fused_moe`."""
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate_size = gate_up_weight.shape[0], gate_up_weight.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_rows = num_tokens * top_k
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    blocks = align_by_expert(topk_ids, num_experts, block_m_for(num_rows, num_experts))
    activated = torch.empty(num_rows, intermediate_size, dtype=hidden.dtype, device=hidden.device)
    _expert_matmul(hidden, gate_up_weight, activated, blocks, inputs_per_row=top_k, gated=True)
    expert_out = torch.empty(num_rows, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _expert_matmul(activated, down_weight, expert_out, blocks, inputs_per_row=1, gated=False)
    _combine_kernel[(num_tokens, triton.cdiv(hidden_size, COMBINE_BLOCK))](
        expert_out, topk_weights, out, hidden_size, expert_out.stride(0), *topk_weights.stride(), out.stride(0),
        TOP_K=top_k, BLOCK=COMBINE_BLOCK,
    )  # fmt: skip
    return out
