"""Paged KV cache: the block allocator (ref counts, SHA-256 prefix-cache keys), the cache tensors and their spec
(bytes per token and block), usage figures and the console's block map. Block tables live with the step inputs
(engine/step_inputs.py); the cache's size is decided in engine/kv_sizing.py."""

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
