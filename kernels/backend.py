"""The attention backend a model calls: a KV store and a paged attention over the same cache."""

from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import torch_paged_attention
from kernels.attention_metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class TorchAttentionBackend:
    """Pure torch path: runs on any device; the reference the Triton kernels are tested against."""

    name: str = "torch"

    def store_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        torch_paged_attention.store_kv(key, value, key_cache, value_cache, slot_mapping)

    def paged_attention(self, query, key_cache, value_cache, metadata, scale) -> torch.Tensor:
        return torch_paged_attention.paged_attention(query, key_cache, value_cache, metadata, scale)


def select_attention_backend(name: str) -> AttentionBackend:
    if name in ("auto", "torch"):
        return TorchAttentionBackend()
    raise ValueError(f"attention_backend must be 'auto' or 'torch', got {name!r}")
