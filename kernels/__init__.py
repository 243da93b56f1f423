"""Attention over the paged KV cache: torch reference paths, Triton kernels and the backend the models call.

Importing this package does not import triton; `select_attention_backend` does, when it is asked for
the Triton backend.
"""

from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.backend import (
    BACKEND_NAMES,
    AttentionBackend,
    AttentionShape,
    TorchAttentionBackend,
    check_backend_name,
    select_attention_backend,
)
from kvserve.kernels.paged_kv import PagedKV
from kvserve.kernels.torch_paged_attention import paged_attention, quantize_per_token_head, store_kv

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionShape",
    "PagedKV",
    "TorchAttentionBackend",
    "check_backend_name",
    "paged_attention",
    "quantize_per_token_head",
    "select_attention_backend",
    "store_kv",
]
