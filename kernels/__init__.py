"""The kernels a model runs: GEMMs, attention over the paged KV cache, fused layer ops and mixture-of-experts MLPs;
torch reference paths, C++ kernels for CPUs, Triton kernels for CUDA, and the registry of backends that bundle
them per device.

Importing this package does not import triton; `select_backend` does, when it is asked for the Triton backend.
"""

from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.backend import (
    BACKEND_NAMES,
    BACKENDS,
    AttentionShape,
    KernelBackend,
    TorchBackend,
    check_backend_name,
    select_backend,
)
from kvserve.kernels.paged_kv import PagedKV
from kvserve.kernels.torch_paged_attention import paged_attention, quantize_per_token_head, store_kv

__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "AttentionMetadata",
    "AttentionShape",
    "KernelBackend",
    "PagedKV",
    "TorchBackend",
    "check_backend_name",
    "paged_attention",
    "quantize_per_token_head",
    "select_backend",
    "store_kv",
]
