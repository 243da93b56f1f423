"""KV usage figures reported by the engine."""

from dataclasses import dataclass


@dataclass(frozen=True)
class KVUsage:
    """Block counts and how much of the allocated space holds live tokens."""

    num_total_blocks: int
    num_used_blocks: int
    num_live_tokens: int
    block_size: int

    @property
    def num_free_blocks(self) -> int:
        return self.num_total_blocks - self.num_used_blocks

    @property
    def usage_fraction(self) -> float:
        return self.num_used_blocks / self.num_total_blocks

    @property
    def slot_utilization(self) -> float:
        """Share of allocated slots (used blocks x block_size) that hold a live token; 1.0 when empty.

        Live tokens are counted per request, so blocks shared through the prefix cache count once per
        holder: with sharing, this can exceed 1 (the cache then holds more tokens than it has slots).
        """
        num_allocated_slots = self.num_used_blocks * self.block_size
        return self.num_live_tokens / num_allocated_slots if num_allocated_slots else 1.0
