"""Attention over the paged KV cache: torch reference paths and the backend the models call."""

from kernels.attention_metadata import AttentionMetadata
from kernels.backend import AttentionBackend, TorchAttentionBackend, select_attention_backend
from kernels.torch_paged_attention import paged_attention, store_kv

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "paged_attention",
    "select_attention_backend",
    "store_kv",
]
