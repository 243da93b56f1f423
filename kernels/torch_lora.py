"""The torch path of the LoRA GEMMs (the CPU backends' and the reference of the Triton kernels): the step's leading
decode rows through every slot they use at once (`DenseRows`), the other tokens per adapter: one shrink GEMM over all
its tokens and one expand GEMM per part of the layer, added into the output in place."""

import torch

from kvserve.kernels.lora import DenseRows, LoraBatch, LoraStacks


def add_lora(out: torch.Tensor, x: torch.Tensor, stacks: LoraStacks, batch: LoraBatch) -> torch.Tensor:
    """`out` [tokens, out_features] plus each token's adapter's (x @ A^T) @ B^T, in place; returns `out`."""
    if batch.dense is not None:
        _add_dense(out, x, stacks, batch.dense)
    rank = stacks.max_rank
    for slot, rows in batch.groups:
        consecutive = isinstance(rows, slice)
        shrunk = x[rows] @ stacks.a[slot].T  # [group tokens, num_parts * rank]
        for part, (first, count) in enumerate(stacks.part_rows):
            h, b = shrunk[:, part * rank : (part + 1) * rank], stacks.b[slot, first : first + count]
            if consecutive:
                out[rows, first : first + count].addmm_(h, b.T)
            else:
                out[:, first : first + count].index_add_(0, rows, h @ b.T)
    return out


def _add_dense(out: torch.Tensor, x: torch.Tensor, stacks: LoraStacks, dense: DenseRows) -> None:
    rows, slots, rank = dense.num_rows, dense.num_slots, stacks.max_rank
    a = stacks.a[:slots].reshape(-1, stacks.a.shape[2])  # [slots * num_parts * rank, in]
    shrunk = (x[:rows] @ a.T).view(rows, slots, -1, rank)  # [rows, slots, num_parts, rank]
    shrunk = shrunk * dense.mask.to(shrunk.dtype)[:, :, None, None]  # each row keeps its own slot's
    for part, (first, count) in enumerate(stacks.part_rows):
        h = shrunk[:, :, part].reshape(rows, slots * rank)
        b = stacks.b[:slots, first : first + count].transpose(0, 1).reshape(count, slots * rank)
        out[:rows, first : first + count].addmm_(h, b.T)
