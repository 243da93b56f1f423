"""Layers the decoders share: linear projections (packed ones too) and RMSNorm's parameters.

On a CPU, float32 GEMMs go through oneDNN instead of the BLAS `F.linear` calls: on the 2-core AMD
EPYC machines here MKL's sgemm runs its AVX2 code, and oneDNN was 2.0-2.9x faster for every shape of
the benchmark model (BENCHMARKS.md). Other dtypes and devices keep `F.linear` (bfloat16 on a CPU
already reaches oneDNN through it).
"""

import torch
import torch.nn.functional as F
from torch import nn

from kernels import AttentionBackend

ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if ONEDNN_LINEAR and x.dtype == torch.float32 and x.device.type == "cpu":
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Several projections of the same input computed as one GEMM (q/k/v, gate/up).

    `parts` maps each checkpoint projection (e.g. "q_proj") to its output size, in the order its
    rows are stacked; the loader copies each checkpoint tensor into its rows.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The output of each part, as views of one GEMM's output."""
        return self(x).split(tuple(self.parts.values()), dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm's weight and epsilon; the backend computes it (in fp32, cast back, as HF does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        return backend.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the sum is the residual stream the next layer adds to."""
        return backend.add_rms_norm(x, residual, self.weight, self.eps)
