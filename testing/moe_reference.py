"""The mixture-of-experts MLP computed the plain way, one expert at a time: what the fused kernels are tested by."""

import torch
import torch.nn.functional as F


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
