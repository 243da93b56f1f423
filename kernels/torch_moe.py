"""Mixture-of-experts expert computation in torch: each token through its top-k experts' SwiGLU MLPs,
weighted by its routing weights and summed. `fused_moe` is the backends' torch path and the one the Triton
kernel is tested against; on a CPU the model runs the same `combine_experts` on the experts' weights packed
for oneDNN at load time (`OneDnnExperts`); the plain per-expert loop the tests check them by is
`kvserve.testing.moe_reference`.

Weights are stacked per expert: `gate_up_weight` [num_experts, 2 * intermediate, hidden] (gate rows
first, then up, as in `PackedLinear`), `down_weight` [num_experts, hidden, intermediate].

Rounding follows HF transformers' default experts path (`grouped_mm_experts_forward`): the
projections and SiLU-and-mul in the model dtype, then each expert output times its fp32 routing
weight and the sum over top-k in fp32, rounded to the model dtype once. (HF's eager loop instead adds
each expert's rounded output into a model-dtype buffer: the same numbers in fp32, more rounding in
16-bit.)
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.kernels import onednn

ExpertMlp = Callable[[int, torch.Tensor], torch.Tensor]  # (expert, its input rows) -> its output rows


def fused_moe(
    hidden: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) for hidden [num_tokens, hidden_size]."""

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, gate_up_weight[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down_weight[expert])

    return combine_experts(hidden, topk_weights, topk_ids, gate_up_weight.shape[0], expert_mlp)


def combine_experts(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert_mlp: ExpertMlp,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_mlp(topk_ids[t, k], hidden[t]), summed in fp32 and rounded once.

    The (token, k) assignments are sorted by expert once, so each expert runs its GEMMs over its own
    contiguous run of rows, and an expert no token picked is never touched."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    rows_by_expert = flat_ids.argsort(stable=True)  # assignment rows t * top_k + k, grouped by expert
    rows_per_expert = torch.bincount(flat_ids, minlength=num_experts).tolist()
    inputs = hidden[rows_by_expert // top_k]
    outputs = torch.empty_like(inputs)
    start = 0
    for expert, count in enumerate(rows_per_expert):
        if count == 0:
            continue
        end = start + count
        outputs[start:end] = expert_mlp(expert, inputs[start:end])
        start = end
    per_assignment = torch.empty_like(outputs).index_copy_(0, rows_by_expert, outputs)
    weighted = per_assignment.view(num_tokens, top_k, hidden_size).float() * topk_weights.float().unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden.dtype)


class OneDnnExperts:
    """Each expert's two projections reordered once, at load time, into oneDNN's blocked layout, as the dense
    layers' weights are on a CPU (engine/models/layers.py: float32 `F.linear` is MKL's sgemm, which takes its slow
    AVX2 path on the AMD machines here; on packed weights the experts' GEMMs take a third to a half of its time,
    benchmarks/moe.py). The copies take as much memory as the weights."""

    def __init__(self, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> None:
        self.gate_up = [onednn.pack(weight) for weight in gate_up_weight]
        self.down = [onednn.pack(weight) for weight in down_weight]

    def fused_moe(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """`fused_moe` on the packed weights."""
        return combine_experts(hidden, topk_weights, topk_ids, len(self.gate_up), self._expert_mlp)

    def _expert_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = onednn.packed_linear(rows, self.gate_up[expert]).chunk(2, dim=-1)
        return onednn.packed_linear(F.silu(gate) * up, self.down[expert])
