"""The attention backend a model calls: a KV store and a paged attention over the same cache,
and the choice of backend per device."""

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import torch_paged_attention
from kernels.attention_metadata import AttentionMetadata
from kernels.paged_kv import PagedKV

BACKEND_NAMES = ("auto", "torch", "triton")


class AttentionBackend(Protocol):
    name: str

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor) -> None: ...

    def paged_attention(
        self, query: torch.Tensor, cache: PagedKV, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionShape:
    """What a backend preallocates for: the most sequences in a step and the query heads' shape."""

    max_num_seqs: int
    num_heads: int
    head_dim: int


@dataclass(frozen=True)
class TorchAttentionBackend:
    """Pure torch path: runs on any device; the reference the Triton kernels are tested against."""

    name: str = "torch"

    def store_kv(self, key, value, cache, slot_mapping) -> None:
        torch_paged_attention.store_kv(key, value, cache, slot_mapping)

    def paged_attention(self, query, cache, metadata, scale) -> torch.Tensor:
        return torch_paged_attention.paged_attention(query, cache, metadata, scale)


def check_backend_name(name: str) -> None:
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")


def select_attention_backend(name: str, device: torch.device, shape: AttentionShape) -> AttentionBackend:
    """`auto`: the Triton kernels on CUDA, the torch path elsewhere; `torch` or `triton` force one."""
    check_backend_name(name)
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend 'triton' needs a CUDA device (got {device.type}); on the CPU the Triton "
            "interpreter runs it when TRITON_INTERPRET=1 is set before triton is imported (slow: for tests)"
        )
    from kernels.triton_backend import TritonAttentionBackend  # imports triton, which CPU-only setups may lack

    return TritonAttentionBackend.create(shape, device)
