"""Paged KV cache: the block allocator (ref counts, prefix-cache keys hashed as vLLM hashes them, the cache events a
router indexes), the cache tensors and their spec (bytes per token and block), usage figures and the console's block
map. Block tables live with the step inputs
(engine/step_inputs.py); the cache's size is decided in engine/kv_sizing.py."""

from kvserve.kvcache.block_allocator import BlockAllocator, DoubleFreeError, KVCacheError, OutOfBlocksError
from kvserve.kvcache.block_hash import AdapterTag, BlockHasher, BlockKey, block_extra_keys, cache_salt_keys
from kvserve.kvcache.cache_tensors import KVCache, KVCacheSpec
from kvserve.kvcache.usage import KVUsage

__all__ = [
    "AdapterTag",
    "BlockAllocator",
    "BlockHasher",
    "BlockKey",
    "DoubleFreeError",
    "KVCache",
    "KVCacheError",
    "KVCacheSpec",
    "KVUsage",
    "OutOfBlocksError",
    "block_extra_keys",
    "cache_salt_keys",
]
