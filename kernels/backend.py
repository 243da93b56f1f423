"""The backend a model calls for its kernels: a KV store and a paged attention over the same cache,
the fused layer ops (RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary embeddings) and the
mixture-of-experts MLPs; and the choice of backend per device."""

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.kernels import torch_paged_attention
from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.cpu_backend import CpuAttentionBackend
from kvserve.kernels.cpu_extension import load_cpu_kernels
from kvserve.kernels.paged_kv import PagedKV
from kvserve.kernels.torch_layer_ops import TorchLayerOps

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")


class AttentionBackend(Protocol):
    """Ops that take their inputs by value may reuse them: `add_rms_norm` may write its results into
    `x` and `residual`, `rotary_embedding` may rotate `query` and `key` in place. Callers use the
    returned tensors and never the inputs again."""

    name: str

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor) -> None: ...

    def paged_attention(
        self, query: torch.Tensor, cache: PagedKV, metadata: AttentionMetadata, scale: float,
        sliding_window: int | None = None, logit_softcap: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Causal attention over each request's paged context; with `sliding_window` W a query at position i
        sees keys at i - W + 1 ... i; with `logit_softcap` c the scaled scores s become c * tanh(s / c)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a packed [tokens, 2n] gate/up output."""
        ...

    def rotary_embedding(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fused_moe(
        self,
        hidden: torch.Tensor,
        gate_up_weight: torch.Tensor,
        down_weight: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Mixture-of-experts MLPs: out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with
        e = topk_ids[t, k], for hidden [tokens, hidden_size]. gate_up_weight [experts, 2 * intermediate, hidden_size]
        (gate rows, then up) and down_weight [experts, hidden_size, intermediate] share hidden's dtype;
        topk_weights [tokens, top_k] (fp32, normalised by the caller), topk_ids [tokens, top_k] (in [0, experts)).
        Returns a new [tokens, hidden_size] tensor in hidden's dtype."""
        ...


@dataclass(frozen=True)
class AttentionShape:
    """What a backend preallocates for: the most sequences in a step and the query heads' shape."""

    max_num_seqs: int
    num_heads: int
    head_dim: int


@dataclass(frozen=True)
class TorchAttentionBackend(TorchLayerOps):
    """Pure torch path: runs on any device; the reference the C++ and Triton kernels are tested against."""

    name: str = "torch"

    def store_kv(self, key, value, cache, slot_mapping) -> None:
        torch_paged_attention.store_kv(key, value, cache, slot_mapping)

    def paged_attention(self, query, cache, metadata, scale, sliding_window=None, logit_softcap=None) -> torch.Tensor:
        return torch_paged_attention.paged_attention(query, cache, metadata, scale, sliding_window, logit_softcap)


def check_backend_name(name: str) -> None:
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")


def select_attention_backend(name: str, device: torch.device, shape: AttentionShape) -> AttentionBackend:
    """`auto`: the Triton kernels on CUDA, the C++ kernels on a CPU (the torch path if they cannot be
    built); `torch`, `cpu` or `triton` force one."""
    check_backend_name(name)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu" if load_cpu_kernels() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu" or not load_cpu_kernels():
            raise ValueError(f"attention_backend 'cpu' needs a CPU device and the C++ kernels (device {device.type})")
        return CpuAttentionBackend()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend 'triton' needs a CUDA device (got {device.type}); on the CPU the Triton "
            "interpreter runs it when TRITON_INTERPRET=1 is set before triton is imported (slow: for tests)"
        )
    from kvserve.kernels.triton_backend import TritonAttentionBackend  # imports triton, which CPU-only setups may lack

    return TritonAttentionBackend.create(shape, device)
