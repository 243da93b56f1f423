"""The torch path of the LoRA GEMMs (the CPU backends' and the reference of the Triton kernels): per adapter used in
the step, one shrink GEMM over all its tokens and one expand GEMM per part of the layer, added into the output."""

import torch

from kvserve.kernels.lora import LoraBatch, LoraStacks


def add_lora(out: torch.Tensor, x: torch.Tensor, stacks: LoraStacks, batch: LoraBatch) -> torch.Tensor:
    """`out` [tokens, out_features] plus each token's adapter's (x @ A^T) @ B^T, in place; returns `out`."""
    rank = stacks.max_rank
    for slot, rows in batch.groups:
        consecutive = isinstance(rows, slice)
        shrunk = x[rows] @ stacks.a[slot].T  # [group tokens, num_parts * rank]
        for part, (first, count) in enumerate(stacks.part_rows):
            delta = shrunk[:, part * rank : (part + 1) * rank] @ stacks.b[slot, first : first + count].T
            if consecutive:
                out[rows, first : first + count] += delta
            else:
                out[:, first : first + count].index_add_(0, rows, delta)
    return out
