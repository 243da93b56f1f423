"""The kernel backend a model calls for everything that is not plain tensor glue: the GEMMs of its linear layers, a
KV store and a paged attention over the same cache, the fused layer ops (RMSNorm, residual add + RMSNorm,
SiLU-and-mul, rotary embeddings) and the mixture-of-experts MLPs; and the registry a backend is chosen from, by
name, for a device.

A backend may keep its own form of a weight, made once at load time (`prepare_linear`, `prepare_experts`: the CPU
backend's oneDNN packing; later, quantized forms), which the layer holds and hands back on every call.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvserve.kernels import torch_lora, torch_paged_attention
from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.block_quant import QuantizedWeight, chunked_quantized_linear
from kvserve.kernels.cpu_extension import load_cpu_kernels
from kvserve.kernels.group_quant import GroupQuantizedWeight, chunked_group_quantized_linear
from kvserve.kernels.lora import LoraBatch, LoraStacks
from kvserve.kernels.paged_kv import PagedKV
from kvserve.kernels.torch_layer_ops import TorchLayerOps


class KernelBackend(Protocol):
    """Ops that take their inputs by value may reuse them: `add_rms_norm` may write its results into
    `x` and `residual`, `rotary_embedding` may rotate `query` and `key` in place. Callers use the
    returned tensors and never the inputs again."""

    name: str
    lora_tiled: bool  # whether `add_lora` reads a `LoraBatch`'s tiles (the Triton kernels) or its torch view

    def prepare_linear(self, weight: torch.Tensor) -> object | None:
        """This backend's own form of a linear layer's weight [out, in], made once at load time (None: it uses the
        weight as it is)."""
        ...

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prepared: object | None
    ) -> torch.Tensor:
        """`F.linear(x, weight, bias)`, on `prepared` (what `prepare_linear` made of `weight`) where there is one."""
        ...

    def quantized_linear(
        self, x: torch.Tensor, weights: tuple[QuantizedWeight, ...], bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`F.linear` of x [rows, in] with a block-quantized weight given as row segments (kernels/block_quant.py),
        computed in float32, in x's dtype."""
        ...

    def group_quantized_linear(
        self, x: torch.Tensor, weight: GroupQuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`F.linear` of x [rows, in] with a group-quantized weight (kernels/group_quant.py; its input quantized
        first where its scheme says), computed in float32, in x's dtype."""
        ...

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, stacks: LoraStacks, batch: LoraBatch) -> torch.Tensor:
        """`out` [tokens, out] plus, for each token `batch` gives an adapter slot, (x @ A^T) @ B^T of that slot's
        adapter in `stacks` (kernels/lora.py), in place; returns `out`."""
        ...

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

    def prepare_experts(self, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> object | None:
        """This backend's own form of a mixture-of-experts block's stacked weights (None: it uses them as they are)."""
        ...

    def fused_moe(
        self,
        hidden: torch.Tensor,
        gate_up_weight: torch.Tensor,
        down_weight: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        prepared: object | None = None,
    ) -> torch.Tensor:
        """Mixture-of-experts MLPs: out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with
        e = topk_ids[t, k], for hidden [tokens, hidden_size]. gate_up_weight [experts, 2 * intermediate, hidden_size]
        (gate rows, then up) and down_weight [experts, hidden_size, intermediate] share hidden's dtype;
        topk_weights [tokens, top_k] (fp32, normalised by the caller), topk_ids [tokens, top_k] (in [0, experts)).
        `prepared`: what `prepare_experts` made of the weights. Returns a new [tokens, hidden_size] tensor in
        hidden's dtype."""
        ...


@dataclass(frozen=True)
class AttentionShape:
    """What a backend preallocates for: the most sequences in a step and the query heads' shape."""

    max_num_seqs: int
    num_heads: int
    head_dim: int


class TorchGemm:
    """Linear layers with `F.linear` on the weights as they are: for backends whose GEMM is the framework's own
    (cuBLAS on CUDA)."""

    def prepare_linear(self, weight: torch.Tensor) -> None:
        return None

    def linear(self, x, weight, bias, prepared) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def quantized_linear(self, x, weights, bias) -> torch.Tensor:
        return chunked_quantized_linear(x, weights, bias)

    def group_quantized_linear(self, x, weight, bias) -> torch.Tensor:
        return chunked_group_quantized_linear(x, weight, bias)

    def add_lora(self, out, x, stacks, batch) -> torch.Tensor:
        return torch_lora.add_lora(out, x, stacks, batch)

    def prepare_experts(self, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> None:
        return None


@dataclass(frozen=True)
class TorchBackend(TorchGemm, TorchLayerOps):
    """Pure torch path: runs on any device; the reference the C++ and Triton kernels are tested against."""

    name: str = "torch"
    lora_tiled: bool = False

    def store_kv(self, key, value, cache, slot_mapping) -> None:
        torch_paged_attention.store_kv(key, value, cache, slot_mapping)

    def paged_attention(self, query, cache, metadata, scale, sliding_window=None, logit_softcap=None) -> torch.Tensor:
        return torch_paged_attention.paged_attention(query, cache, metadata, scale, sliding_window, logit_softcap)


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: why it cannot run on a device (None: it can), and how to build it for one."""

    unavailable_on: Callable[[torch.device], str | None]
    build: Callable[[torch.device, AttentionShape], KernelBackend]


def _cpu_backend_unavailable(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"it runs on a CPU device (got {device.type})"
    return None if load_cpu_kernels() else "its C++ kernels could not be built (the log says why)"


def _build_cpu_backend(device: torch.device, shape: AttentionShape) -> KernelBackend:
    from kvserve.kernels.cpu_backend import CpuBackend

    return CpuBackend()


def _triton_unavailable(device: torch.device) -> str | None:
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (
        f"it needs a CUDA device (got {device.type}); on the CPU the Triton interpreter runs it when "
        "TRITON_INTERPRET=1 is set before triton is imported (slow: for tests)"
    )


def _build_triton_backend(device: torch.device, shape: AttentionShape) -> KernelBackend:
    from kvserve.kernels.triton_backend import TritonBackend  # imports triton, which CPU-only setups may lack

    return TritonBackend.create(shape, device)


BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry(lambda device: None, lambda device, shape: TorchBackend()),
    "cpu": BackendEntry(_cpu_backend_unavailable, _build_cpu_backend),
    "triton": BackendEntry(_triton_unavailable, _build_triton_backend),
}
# What `auto` picks on each kind of device: the first of these that can run there.
AUTO_ORDER = {"cuda": ("triton",), "cpu": ("cpu", "torch")}
BACKEND_NAMES = ("auto", *BACKENDS)


def check_backend_name(name: str) -> None:
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")


def select_backend(name: str, device: torch.device, shape: AttentionShape) -> KernelBackend:
    """The backend registered as `name`, for `device`; `auto`: the first of the device's `AUTO_ORDER` that can run
    there (the Triton kernels on CUDA, the C++ kernels on a CPU, else the torch path)."""
    check_backend_name(name)
    if name == "auto":
        candidates = AUTO_ORDER.get(device.type, ("torch",))
        name = next((n for n in candidates if BACKENDS[n].unavailable_on(device) is None), "torch")
    entry = BACKENDS[name]
    why_not = entry.unavailable_on(device)
    if why_not is not None:
        raise ValueError(f"attention_backend {name!r} cannot run here: {why_not}")
    return entry.build(device, shape)
