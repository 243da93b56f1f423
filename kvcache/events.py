"""What happened to the prefix cache, as the allocator saw it: blocks stored, blocks removed, everything cleared.

These are the facts a KV-cache-aware router indexes (engine/kv_events.py publishes them in vLLM's wire format). A
block is "stored" when it becomes findable by its hash and "removed" when its contents are evicted; blocks taken
and freed again by requests change nothing a router cares about.
"""

from dataclasses import dataclass

from kvserve.kvcache.block_hash import ExtraKeys


@dataclass(frozen=True)
class BlocksStored:
    """A chain of newly cached blocks, each the next one's parent; `parent_block_hash` is the block before the
    first (None when the first starts a sequence). `token_ids` holds every block's tokens, in order."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[ExtraKeys, ...]  # one per block
    lora_id: int | None = None  # the LoRA adapter's id (the engine sets it; the allocator knows only its key)

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter the blocks were computed under, from their keys (one chain: one adapter)."""
        return next((key[1] for key in self.extra_keys[0] or () if key[0] == "lora"), None)


@dataclass(frozen=True)
class BlocksRemoved:
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


CacheEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


def merge_runs(events: list[CacheEvent]) -> list[CacheEvent]:
    """`events` with each run of stores that continue one chain (and each run of removals) as one event, in order:
    a request's newly full blocks are cached one at a time but make one event, as in vLLM."""
    merged: list[CacheEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, BlocksStored) and isinstance(last, BlocksStored) and _continues(last, event):
            merged[-1] = BlocksStored(
                last.block_hashes + event.block_hashes,
                last.parent_block_hash,
                last.token_ids + event.token_ids,
                last.extra_keys + event.extra_keys,
            )
        elif isinstance(event, BlocksRemoved) and isinstance(last, BlocksRemoved):
            merged[-1] = BlocksRemoved(last.block_hashes + event.block_hashes)
        else:
            merged.append(event)
    return merged


def _continues(chain: BlocksStored, event: BlocksStored) -> bool:
    return event.parent_block_hash == chain.block_hashes[-1]
