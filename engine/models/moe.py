"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k
experts, whose weights are stacked in two tensors the backend's `fused_moe` runs over; Qwen2-MoE adds a shared
expert that every token takes, scaled by a sigmoid gate.

The checkpoints store each expert's projections apart (`experts.{e}.gate_proj.weight`, ...); `Experts` maps
each of those names onto its rows of the stacked tensors, so they load by name like any other weight.
"""

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.engine.models.layers import Linear
from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.engine.parallel.sharding import ShardPlan
from kvserve.kernels import KernelBackend


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k probabilities are divided by their sum (Mixtral always; Qwen's norm_topk_prob)
    sparse_layers: tuple[int, ...]  # layers with experts; the others keep the dense MLP
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none


class Experts(nn.Module):
    """All experts' weights, stacked: gate and up rows together as in `PackedLinear`, then down."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # The backend's own form of the weights (`prepare_weights`; on a CPU, oneDNN's packed layout), if it keeps one.
        self.prepared: object | None = None

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Each expert's checkpoint weight names and the part of the stacked tensors they fill."""
        size = self.intermediate_size
        tensors = {}
        for expert in range(self.gate_up_weight.shape[0]):
            tensors[f"{prefix}.{expert}.gate_proj.weight"] = self.gate_up_weight[expert, :size]
            tensors[f"{prefix}.{expert}.up_proj.weight"] = self.gate_up_weight[expert, size:]
            tensors[f"{prefix}.{expert}.down_proj.weight"] = self.down_weight[expert]
        return tensors


class SparseMoeBlock(nn.Module):
    """With a tensor-parallel `group`, every rank routes every token (the router is whole on each) through its
    slice of each expert's intermediate size (and of the shared expert's): the partial outputs are summed by
    one all-reduce, as a row-parallel projection's."""

    def __init__(
        self, hidden_size: int, config: MoeConfig, dense_mlp: type[nn.Module], plan: ShardPlan,
        group: TensorParallelGroup | None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config = config
        self.group = group
        self.gate = Linear(hidden_size, config.num_experts, bias=False)  # the router
        self.experts = Experts(config.num_experts, hidden_size, plan.expert_intermediate_size)
        if config.shared_expert_intermediate_size:
            # No all-reduce of its own: its partial output is added to the experts' and summed with it.
            self.shared_expert = dense_mlp(hidden_size, plan.shared_expert_intermediate_size, bias=False)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        # Tokens routed to each expert since the engine last read them: counted on the device, read rarely
        # (a read waits for the device), for the expert-load metrics.
        self.register_buffer("expert_tokens", torch.zeros(config.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor, backend: KernelBackend) -> torch.Tensor:
        weights, expert_ids = self.route(x, backend)
        routed = expert_ids.flatten()
        # Not bincount: on CUDA it reads the largest id back, which a captured graph cannot do.
        self.expert_tokens.index_add_(0, routed, torch.ones_like(routed))
        experts = self.experts
        out = backend.fused_moe(x, experts.gate_up_weight, experts.down_weight, weights, expert_ids, experts.prepared)
        if self.config.shared_expert_intermediate_size:
            # The sigmoid gate is the same on every rank, so gating each rank's part gates their sum.
            gate = torch.sigmoid(self.shared_expert_gate(x, backend))
            out = out + gate * self.shared_expert(x, backend)
        return out if self.group is None else self.group.all_reduce(out)

    def route(self, x: torch.Tensor, backend: KernelBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k routing weights (fp32) and expert ids: a softmax over all experts, in fp32 as HF."""
        probs = torch.softmax(self.gate(x, backend).float(), dim=-1)
        weights, expert_ids = probs.topk(self.config.top_k, dim=-1)
        if self.config.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, expert_ids
