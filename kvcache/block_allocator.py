"""Fixed-size KV block allocator with reference counts.

Blocks are shared by reference count (fork), so a later prefix cache can hand the same
physical block to several requests; a block returns to the free list only when its last
holder frees it.
"""

from collections import Counter, deque


class KVCacheError(Exception):
    """Base class of allocator errors."""


class OutOfBlocksError(KVCacheError):
    """Raised when more blocks are requested than are free."""


class DoubleFreeError(KVCacheError):
    """Raised when a block that is not allocated is freed (or forked)."""


class BlockAllocator:
    """Hands out block ids in [0, num_blocks) from a free list and tracks their ref counts."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks, each with ref count 1; all or nothing."""
        if num_blocks > len(self._free_block_ids):
            raise OutOfBlocksError(f"requested {num_blocks} blocks but only {len(self._free_block_ids)} are free")
        block_ids = [self._free_block_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

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
                self._free_block_ids.append(block_id)

    def _num_references(self, block_id: int) -> int:
        # An id outside the pool was never handed out; a negative one must not index a real block from the end.
        return self._ref_counts[block_id] if 0 <= block_id < self.num_blocks else 0
