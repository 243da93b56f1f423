"""A picture of the KV cache: every block's state as one byte, for the console.

Built from the allocator alone (ref counts and the blocks that are cached but held by nobody); who
holds which block is the scheduler's business (see engine/engine_state.py). Only the engine thread
may build one, between steps; the result is immutable and can be read anywhere.
"""

import base64
import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvserve.kvcache.block_allocator import BlockAllocator

# One run of equal bytes; DOTALL so that byte 10 ("\n") matches too.
_RUN = re.compile(rb"(.)\1*", re.DOTALL)


class BlockState(enum.IntEnum):
    """What a block holds, as the byte the map stores for it."""

    FREE = 0  # nothing worth keeping: never cached, or its contents were evicted
    HELD = 1  # held by exactly one request
    SHARED = 2  # held by several (ref count > 1)
    EVICTABLE = 3  # held by nobody but still findable by the prefix cache, until an allocation takes it


STATE_NAMES = tuple(state.name.lower() for state in BlockState)  # indexed by the state's byte


@dataclass(frozen=True)
class BlockMap:
    """Every block's `BlockState`, and the ref count of each shared block."""

    states: bytes  # states[block_id] is a BlockState
    shared: tuple[tuple[int, int], ...]  # (block id, ref count) of every SHARED block, by block id

    @property
    def num_blocks(self) -> int:
        return len(self.states)

    def count(self, state: BlockState) -> int:
        return self.states.count(state)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds: the allocator's `num_used_blocks`."""
        return self.count(BlockState.HELD) + self.count(BlockState.SHARED)


def build_block_map(allocator: BlockAllocator) -> BlockMap:
    """The state of every block of `allocator`, read in O(num_blocks) with C-speed loops where possible."""
    ref_counts = allocator.ref_counts()
    clamp = [BlockState.FREE, BlockState.HELD] + [BlockState.SHARED] * (max(ref_counts) - 1)
    states = bytearray(map(clamp.__getitem__, ref_counts))
    for block_id in allocator.evictable_block_ids():
        states[block_id] = BlockState.EVICTABLE
    shared_ids = (match.start() for match in re.finditer(bytes([BlockState.SHARED]), states))
    return BlockMap(states=bytes(states), shared=tuple((block_id, ref_counts[block_id]) for block_id in shared_ids))


def block_ranges(block_ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """`block_ids` as runs of consecutive ids, each [start, end); a request's blocks are mostly consecutive."""
    if not block_ids:
        return ()
    breaks = [i for i in range(1, len(block_ids)) if block_ids[i] != block_ids[i - 1] + 1]
    starts, ends = [0, *breaks], [*breaks, len(block_ids)]
    return tuple((block_ids[start], block_ids[end - 1] + 1) for start, end in zip(starts, ends, strict=True))


def run_lengths(states: bytes, max_runs: int | None = None) -> list[tuple[int, int]] | None:
    """`states` as (byte, run length) pairs; None as soon as there would be more than `max_runs`."""
    runs = []
    for match in _RUN.finditer(states):
        if max_runs is not None and len(runs) == max_runs:
            return None
        runs.append((match.group()[0], match.end() - match.start()))
    return runs


def encode_states(states: bytes) -> tuple[Literal["base64", "rle"], str | list[tuple[int, int]]]:
    """The shorter JSON of the two: the bytes in base64, or the runs as [[state, length], ...].

    A run costs at least 6 characters of JSON ("[0,1],"), so counting stops once runs cannot win.
    """
    encoded = base64.b64encode(states).decode("ascii")
    runs = run_lengths(states, max_runs=len(encoded) // 6)
    if runs is None or _runs_json_length(runs) >= len(encoded) + 2:  # + the quotes around the base64 string
        return "base64", encoded
    return "rle", runs


def _runs_json_length(runs: list[tuple[int, int]]) -> int:
    # "[s,n]," per run, and the outer brackets; the state is one digit.
    return sum(len(str(length)) for _, length in runs) + 5 * len(runs) + 1
