"""Mixture-of-experts expert computation in torch: each token through its top-k experts' SwiGLU MLPs,
weighted by its routing weights and summed. `fused_moe` is the path the CPU backends run and the one
the Triton kernel is tested against; `moe_reference` is the plain per-expert loop the tests check it by.

Weights are stacked per expert: `gate_up_weight` [num_experts, 2 * intermediate, hidden] (gate rows
first, then up, as in `PackedLinear`), `down_weight` [num_experts, hidden, intermediate].

Rounding follows HF transformers' default experts path (`grouped_mm_experts_forward`): the
projections and SiLU-and-mul in the model dtype, then each expert output times its fp32 routing
weight and the sum over top-k in fp32, rounded to the model dtype once. (HF's eager loop instead adds
each expert's rounded output into a model-dtype buffer: the same numbers in fp32, more rounding in
16-bit.)
"""

import torch
import torch.nn.functional as F


def fused_moe(
    hidden: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) for hidden [num_tokens, hidden_size].

    The (token, k) assignments are sorted by expert once, so each expert runs two GEMMs over its own
    contiguous run of rows, and an expert no token picked is never touched."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    rows_by_expert = flat_ids.argsort(stable=True)  # assignment rows t * top_k + k, grouped by expert
    rows_per_expert = torch.bincount(flat_ids, minlength=gate_up_weight.shape[0]).tolist()
    inputs = hidden[rows_by_expert // top_k]
    outputs = torch.empty_like(inputs)
    start = 0
    for expert, count in enumerate(rows_per_expert):
        if count == 0:
            continue
        end = start + count
        gate, up = F.linear(inputs[start:end], gate_up_weight[expert]).chunk(2, dim=-1)
        outputs[start:end] = F.linear(F.silu(gate) * up, down_weight[expert])
        start = end
    per_assignment = torch.empty_like(outputs).index_copy_(0, rows_by_expert, outputs)
    weighted = per_assignment.view(num_tokens, top_k, hidden_size).float() * topk_weights.float().unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden.dtype)


def moe_reference(
    hidden: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The same sum as `fused_moe`, one expert at a time over the tokens that picked it (for tests)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(gate_up_weight.shape[0]):
        tokens, slots = torch.where(topk_ids == expert)
        if tokens.numel() == 0:
            continue
        gate, up = F.linear(hidden[tokens], gate_up_weight[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down_weight[expert])
        out.index_add_(0, tokens, expert_out.float() * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)
