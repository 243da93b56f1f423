"""Paged KV cache: block allocation, per-request block tables, cache tensors and their sizing."""

from kvserve.kvcache.block_allocator import (
    BlockAllocator,
    BlockKey,
    DoubleFreeError,
    KVCacheError,
    OutOfBlocksError,
    root_digest,
)
from kvserve.kvcache.cache_tensors import KVCache, KVCacheSpec
from kvserve.kvcache.usage import KVUsage

__all__ = [
    "BlockAllocator",
    "BlockKey",
    "DoubleFreeError",
    "KVCache",
    "KVCacheError",
    "KVCacheSpec",
    "KVUsage",
    "OutOfBlocksError",
    "root_digest",
]
