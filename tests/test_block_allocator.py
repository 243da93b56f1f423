"""BlockAllocator: free list, reference counts, and the errors that guard them."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.kvcache import BlockAllocator, DoubleFreeError, KVCacheError, OutOfBlocksError


def snapshot(allocator: BlockAllocator) -> tuple[int, list[int]]:
    return allocator.num_free_blocks, [allocator.ref_count(block_id) for block_id in range(allocator.num_blocks)]


def test_new_allocator_has_every_block_free():
    allocator = BlockAllocator(5)
    assert allocator.num_free_blocks == 5
    assert allocator.num_used_blocks == 0
    assert all(allocator.ref_count(block_id) == 0 for block_id in range(5))


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_allocator_needs_at_least_one_block(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(num_blocks)


def test_allocate_hands_out_distinct_blocks_with_ref_count_one():
    allocator = BlockAllocator(6)
    block_ids = allocator.allocate(4)
    assert len(set(block_ids)) == 4
    assert all(0 <= block_id < 6 for block_id in block_ids)
    assert [allocator.ref_count(block_id) for block_id in block_ids] == [1, 1, 1, 1]
    assert allocator.num_free_blocks == 2
    assert allocator.num_used_blocks == 4


def test_allocate_zero_blocks_returns_nothing_and_changes_nothing():
    allocator = BlockAllocator(3)
    assert allocator.allocate(0) == []
    assert allocator.num_free_blocks == 3


def test_successive_allocations_never_share_a_block():
    allocator = BlockAllocator(6)
    first = allocator.allocate(3)
    second = allocator.allocate(3)
    assert set(first).isdisjoint(second)
    assert allocator.num_free_blocks == 0


def test_allocating_more_blocks_than_free_raises_and_takes_nothing():
    allocator = BlockAllocator(4)
    held = allocator.allocate(2)
    before = snapshot(allocator)
    with pytest.raises(OutOfBlocksError, match="requested 3 blocks but only 2 are free"):
        allocator.allocate(3)
    assert snapshot(allocator) == before
    assert set(allocator.allocate(2)).isdisjoint(held)


def test_exhausted_allocator_refuses_even_one_block():
    allocator = BlockAllocator(2)
    allocator.allocate(2)
    with pytest.raises(OutOfBlocksError):
        allocator.allocate(1)


def test_allocator_errors_are_kv_cache_errors():
    assert issubclass(OutOfBlocksError, KVCacheError)
    assert issubclass(DoubleFreeError, KVCacheError)


def test_freed_blocks_can_be_allocated_again():
    allocator = BlockAllocator(2)
    block_ids = allocator.allocate(2)
    allocator.free(block_ids)
    assert allocator.num_free_blocks == 2
    assert sorted(allocator.allocate(2)) == sorted(block_ids)


def test_fork_adds_a_reference_and_returns_the_same_ids():
    allocator = BlockAllocator(4)
    block_ids = allocator.allocate(2)
    forked = allocator.fork(block_ids)
    assert forked == block_ids
    assert forked is not block_ids
    assert [allocator.ref_count(block_id) for block_id in block_ids] == [2, 2]
    assert allocator.num_used_blocks == 2


def test_shared_block_returns_to_free_list_only_when_last_holder_frees_it():
    allocator = BlockAllocator(3)
    block_ids = allocator.allocate(2)
    allocator.fork(block_ids)
    allocator.free(block_ids)
    assert [allocator.ref_count(block_id) for block_id in block_ids] == [1, 1]
    assert allocator.num_free_blocks == 1
    allocator.free(block_ids)
    assert [allocator.ref_count(block_id) for block_id in block_ids] == [0, 0]
    assert allocator.num_free_blocks == 3


def test_freeing_a_block_twice_raises_double_free():
    allocator = BlockAllocator(3)
    block_ids = allocator.allocate(2)
    allocator.free(block_ids)
    with pytest.raises(DoubleFreeError):
        allocator.free(block_ids)
    assert allocator.num_free_blocks == 3


def test_freeing_a_never_allocated_block_raises_double_free():
    allocator = BlockAllocator(3)
    held = allocator.allocate(1)
    unallocated = next(block_id for block_id in range(3) if block_id not in held)
    before = snapshot(allocator)
    with pytest.raises(DoubleFreeError):
        allocator.free([unallocated])
    assert snapshot(allocator) == before


def test_freeing_the_same_block_twice_in_one_call_raises_and_frees_nothing():
    allocator = BlockAllocator(3)
    block_ids = allocator.allocate(2)
    before = snapshot(allocator)
    with pytest.raises(DoubleFreeError):
        allocator.free([block_ids[0], block_ids[1], block_ids[0]])
    assert snapshot(allocator) == before


def test_freeing_a_shared_block_once_per_holder_in_one_call_is_allowed():
    allocator = BlockAllocator(2)
    block_ids = allocator.allocate(1)
    allocator.fork(block_ids)
    allocator.free(block_ids + block_ids)
    assert allocator.num_free_blocks == 2


def test_failed_free_leaves_the_valid_blocks_in_the_call_allocated():
    allocator = BlockAllocator(4)
    held = allocator.allocate(2)
    unallocated = next(block_id for block_id in range(4) if block_id not in held)
    with pytest.raises(DoubleFreeError):
        allocator.free([*held, unallocated])
    assert [allocator.ref_count(block_id) for block_id in held] == [1, 1]
    assert allocator.num_used_blocks == 2


def test_forking_an_unallocated_block_raises_and_forks_nothing():
    allocator = BlockAllocator(3)
    held = allocator.allocate(1)
    unallocated = next(block_id for block_id in range(3) if block_id not in held)
    before = snapshot(allocator)
    with pytest.raises(DoubleFreeError, match="not allocated"):
        allocator.fork([*held, unallocated])
    assert snapshot(allocator) == before


@pytest.mark.parametrize("block_id", [-1, -3, 3, 7])
def test_block_ids_outside_the_pool_are_never_allocated(block_id):
    # A negative id must not alias a real block through Python's negative indexing.
    allocator = BlockAllocator(3)
    allocator.allocate(3)
    before = snapshot(allocator)
    with pytest.raises(DoubleFreeError):
        allocator.free([block_id])
    with pytest.raises(DoubleFreeError):
        allocator.fork([block_id])
    assert snapshot(allocator) == before


@settings(max_examples=100, deadline=None)
@given(
    num_blocks=st.integers(1, 8),
    data=st.data(),
)
def test_free_of_anything_not_held_raises_and_changes_nothing(num_blocks, data):
    allocator = BlockAllocator(num_blocks)
    held = allocator.allocate(data.draw(st.integers(0, num_blocks), label="num_held"))
    extra = data.draw(
        st.lists(st.integers(-2 * num_blocks, 2 * num_blocks), min_size=1, max_size=4).filter(
            lambda ids: any(Counter(held)[block_id] < count for block_id, count in Counter(ids).items())
        ),
        label="over_freed",
    )
    before = snapshot(allocator)
    with pytest.raises(DoubleFreeError):
        allocator.free(extra)
    assert snapshot(allocator) == before


class AllocatorWithHolders(RuleBasedStateMachine):
    """Several holders allocate, share each other's blocks and free them, as block tables do.

    The model is the holders' lists: a block's ref count must equal how often it appears in them.
    """

    NUM_HOLDERS = 4

    @initialize(num_blocks=st.integers(1, 12))
    def make_allocator(self, num_blocks):
        self.allocator = BlockAllocator(num_blocks)
        self.holders: list[list[int]] = [[] for _ in range(self.NUM_HOLDERS)]

    def held_counts(self) -> Counter[int]:
        return Counter(block_id for held in self.holders for block_id in held)

    @rule(holder=st.integers(0, NUM_HOLDERS - 1), num_blocks=st.integers(0, 6))
    def allocate(self, holder, num_blocks):
        held_before = self.held_counts()
        num_free = self.allocator.num_free_blocks
        if num_blocks > num_free:
            before = snapshot(self.allocator)
            with pytest.raises(OutOfBlocksError):
                self.allocator.allocate(num_blocks)
            assert snapshot(self.allocator) == before
            return
        block_ids = self.allocator.allocate(num_blocks)
        assert len(block_ids) == num_blocks
        assert len(set(block_ids)) == num_blocks, "one block handed out twice in one call"
        assert not set(block_ids) & set(held_before), "a block still held by someone was handed out again"
        assert self.allocator.num_free_blocks == num_free - num_blocks
        self.holders[holder].extend(block_ids)

    @precondition(lambda self: any(self.holders))
    @rule(data=st.data())
    def fork(self, data):
        source = data.draw(st.sampled_from([held for held in self.holders if held]), label="source")
        shared = data.draw(st.lists(st.sampled_from(source), min_size=1, max_size=len(source)), label="shared")
        target = data.draw(st.integers(0, self.NUM_HOLDERS - 1), label="target")
        num_free = self.allocator.num_free_blocks
        assert self.allocator.fork(shared) == shared
        assert self.allocator.num_free_blocks == num_free
        self.holders[target].extend(shared)

    @precondition(lambda self: any(self.holders))
    @rule(data=st.data())
    def free(self, data):
        holder = data.draw(st.sampled_from([i for i, held in enumerate(self.holders) if held]), label="holder")
        held = self.holders[holder]
        indices = data.draw(st.sets(st.integers(0, len(held) - 1), min_size=1), label="indices")
        freed = [held[i] for i in sorted(indices)]
        self.allocator.free(freed)
        self.holders[holder] = [block_id for i, block_id in enumerate(held) if i not in indices]
        for block_id in freed:
            assert (self.allocator.ref_count(block_id) == 0) == (block_id not in self.held_counts())

    @rule(block_id=st.integers(0, 11), times=st.integers(1, 3))
    def free_more_than_held_is_refused(self, block_id, times):
        block_id %= self.allocator.num_blocks
        if self.held_counts()[block_id] >= times:
            return
        before = snapshot(self.allocator)
        with pytest.raises(DoubleFreeError):
            self.allocator.free([block_id] * times)
        assert snapshot(self.allocator) == before

    @rule(block_id=st.integers(0, 11))
    def fork_of_unallocated_is_refused(self, block_id):
        block_id %= self.allocator.num_blocks
        if block_id in self.held_counts():
            return
        before = snapshot(self.allocator)
        with pytest.raises(DoubleFreeError):
            self.allocator.fork([block_id])
        assert snapshot(self.allocator) == before

    @invariant()
    def every_block_is_free_xor_referenced(self):
        # The free list is private; reading it is the only way to see a block that is both free and referenced.
        free_block_ids = list(self.allocator._free_block_ids)
        assert len(set(free_block_ids)) == len(free_block_ids), "a block is on the free list twice"
        unreferenced = {
            block_id for block_id in range(self.allocator.num_blocks) if not self.allocator.ref_count(block_id)
        }
        assert set(free_block_ids) == unreferenced
        assert self.allocator.num_free_blocks + self.allocator.num_used_blocks == self.allocator.num_blocks

    @invariant()
    def ref_counts_equal_the_number_of_holdings(self):
        held = self.held_counts()
        for block_id in range(self.allocator.num_blocks):
            assert self.allocator.ref_count(block_id) == held[block_id], f"block {block_id}"
        assert self.allocator.num_used_blocks == len(held)

    def teardown(self):
        for held in self.holders:
            self.allocator.free(held)
            held.clear()
        assert self.allocator.num_free_blocks == self.allocator.num_blocks
        assert all(self.allocator.ref_count(block_id) == 0 for block_id in range(self.allocator.num_blocks))
        assert sorted(self.allocator.allocate(self.allocator.num_blocks)) == list(range(self.allocator.num_blocks))


AllocatorWithHolders.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_allocator_with_holders_keeps_ref_counts_consistent = AllocatorWithHolders.TestCase
