"""Torch references of the fused layer ops (RMSNorm, RMSNorm after a residual add, SiLU-and-mul,
rotary embeddings), computed as HF transformers computes them; the C++ and Triton versions are
tested against these."""

import torch
import torch.nn.functional as F

from kvserve.kernels import torch_moe


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, cast back, times the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the sum is the residual stream the next layer adds to."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the packed [..., 2n] output of a gate/up projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [tokens, heads, D] and key [tokens, kv_heads, D] by their positions' angles
    (cos/sin tables [max_positions, D] in fp32, cast to the query's dtype as HF does)."""
    cos = cos[positions].unsqueeze(1).to(query.dtype)
    sin = sin[positions].unsqueeze(1).to(query.dtype)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated_half * sin


class TorchLayerOps:
    """The layer-op methods of a backend, in torch: for backends with no kernels of their own for them."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def rotary_embedding(self, positions, query, key, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding(positions, query, key, cos, sin)

    def fused_moe(self, hidden, gate_up_weight, down_weight, topk_weights, topk_ids, prepared=None) -> torch.Tensor:
        return torch_moe.fused_moe(hidden, gate_up_weight, down_weight, topk_weights, topk_ids)
