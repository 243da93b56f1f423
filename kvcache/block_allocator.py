"""Fixed-size KV block allocator with reference counts and a cache of full blocks' contents.

Blocks are shared by reference count. A full block can be registered under a `BlockKey` (its tokens and the hash
of everything before it); when its last holder frees it, it keeps its contents and stays findable until a new
allocation needs the space, least recently freed first.

Keys are SHA-256 hashes chained from block to block (kvcache/block_hash.py), so no two different prefixes share a
key (with Python's `hash`, a crafted prompt could collide with another user's chain and be answered from their
cache, as in vLLM's advisory GHSA-rm76-4mrf-v9r8); a lookup checks the tokens and parent too.

With `record_events`, the allocator notes every block that becomes findable or stops being findable (kvcache/
events.py), for the KV-cache events a router subscribes to; `take_events` hands them over once per step.
"""

from collections import Counter, OrderedDict, deque
from collections.abc import Callable

from kvserve.kvcache.block_hash import BlockKey
from kvserve.kvcache.events import AllBlocksCleared, BlocksRemoved, BlocksStored, CacheEvent, merge_runs


class KVCacheError(Exception):
    """Base class of allocator errors."""


class OutOfBlocksError(KVCacheError):
    """Raised when more blocks are requested than are free."""


class DoubleFreeError(KVCacheError):
    """Raised when a block that is not allocated is freed (or forked)."""


class BlockAllocator:
    """Hands out block ids in [0, num_blocks), tracks their ref counts, and keeps freed full blocks findable."""

    def __init__(self, num_blocks: int, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))  # hold nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, least recently freed first
        self._ref_counts = [0] * num_blocks
        self._block_by_digest: dict[bytes, int] = {}
        self._key_by_block: dict[int, BlockKey] = {}
        self._events: list[CacheEvent] | None = [] if record_events else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached ones and cached ones nobody holds."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_by_block)

    def ref_counts(self) -> list[int]:
        """Every block's holder count (a copy), for a whole-pool view such as the console's map."""
        return list(self._ref_counts)

    def evictable_block_ids(self) -> list[int]:
        """Blocks nobody holds that still hold cached contents, least recently freed first."""
        return list(self._evictable)

    def cached_keys(self) -> list[BlockKey]:
        """The key of every block findable by the prefix cache (held or not)."""
        return list(self._key_by_block.values())

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks, each with ref count 1; all or nothing.

        Never-cached blocks go first; then cached ones are evicted, least recently freed first.
        """
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocksError(f"requested {num_blocks} blocks but only {self.num_free_blocks} are free")
        block_ids = []
        for _ in range(num_blocks):
            if self._free_block_ids:
                block_ids.append(self._free_block_ids.popleft())
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._forget(block_id)
                block_ids.append(block_id)
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def lookup(self, key: BlockKey) -> int | None:
        """The cached block holding exactly `key`'s contents (parent and tokens checked too, not only the digest)."""
        block_id = self._block_by_digest.get(key.digest)
        if block_id is None or self._key_by_block[block_id] != key:
            return None
        return block_id

    def take_cached(self, block_id: int) -> None:
        """Add a holder to a cached block found by `lookup`, taking it off the eviction list if nobody held it."""
        if block_id not in self._key_by_block:
            raise DoubleFreeError(f"block {block_id} is not cached")
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def register(self, block_id: int, key: BlockKey) -> None:
        """Make an allocated, full block findable by `key`; a key already cached keeps its block."""
        if self._num_references(block_id) == 0:
            raise DoubleFreeError(f"cannot register block {block_id}: it is not allocated")
        if key.digest in self._block_by_digest or block_id in self._key_by_block:
            return
        self._block_by_digest[key.digest] = block_id
        self._key_by_block[block_id] = key
        if self._events is not None:
            self._events.append(BlocksStored((key.digest,), key.parent_digest, key.token_ids, (key.extra_keys,)))

    def _forget(self, block_id: int) -> None:
        key = self._key_by_block.pop(block_id)
        del self._block_by_digest[key.digest]
        if self._events is not None:
            self._events.append(BlocksRemoved((key.digest,)))

    def forget_cached(self, matches: Callable[[BlockKey], bool]) -> int:
        """Forget the contents of every cached block whose key `matches` (an unloaded adapter's): as `clear_cache`
        does, for those blocks only; how many there were."""
        forgotten = [block_id for block_id, key in self._key_by_block.items() if matches(key)]
        for block_id in forgotten:
            self._forget(block_id)
            if block_id in self._evictable:
                del self._evictable[block_id]
                self._free_block_ids.append(block_id)
        return len(forgotten)

    def clear_cache(self) -> None:
        """Forget every cached block's contents: blocks nobody holds become free, held ones stay with their
        holders (and are not cached when freed)."""
        self._free_block_ids.extend(self._evictable)
        self._evictable.clear()
        self._block_by_digest.clear()
        self._key_by_block.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())

    def take_events(self) -> list[CacheEvent]:
        """What changed in the cache since the last call, oldest first (consecutive stores of one chain as one
        event); empty unless the allocator records events."""
        if not self._events:
            return []
        events, self._events = merge_runs(self._events), []
        return events

    def fork(self, block_ids: list[int]) -> list[int]:
        """Share already allocated blocks with one more holder; returns the same ids."""
        for block_id in block_ids:
            if self._num_references(block_id) == 0:
                raise DoubleFreeError(f"cannot fork block {block_id}: it is not allocated")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1
        return list(block_ids)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list."""
        for block_id, count in Counter(block_ids).items():
            if self._num_references(block_id) < count:
                raise DoubleFreeError(
                    f"block {block_id} freed {count} time(s) but holds {self._num_references(block_id)} reference(s)"
                )
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._key_by_block:
                    self._evictable[block_id] = None
                else:
                    self._free_block_ids.append(block_id)

    def _num_references(self, block_id: int) -> int:
        # An id outside the pool was never handed out; a negative one must not index a real block from the end.
        return self._ref_counts[block_id] if 0 <= block_id < self.num_blocks else 0
