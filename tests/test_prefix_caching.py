"""Prefix caching: repeated prompt prefixes reuse cached KV blocks; outputs are unchanged, nothing leaks."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine import LLM, RequestDelta, SamplingParams
from kvserve.kvcache import BlockAllocator, BlockHasher, BlockKey, DoubleFreeError, cache_salt_keys

BLOCK_SIZE = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _tokens(vocab_size: int, n: int, seed: int) -> list[int]:
    return torch.randint(4, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def vocab_size(tiny_checkpoints) -> int:
    return json.loads((tiny_checkpoints["llama"] / "config.json").read_text())["vocab_size"]


def _workload(vocab_size: int) -> list[list[int]]:
    """Prompts sharing prefixes of 31, 32, 33 and 48 tokens (block boundaries), plus repeats of whole prompts."""
    shared = _tokens(vocab_size, 48, seed=1)
    prompts = [
        shared[:n] + _tokens(vocab_size, extra, seed=10 + n + extra) for n in (31, 32, 33, 48) for extra in (1, 9)
    ]
    return [*prompts, prompts[0], prompts[3], shared[:32], shared[:32]]


def _run(model_dir, prompts, **config) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), **config)
    # Two waves: the second finds what the first left in the cache.
    first = llm.generate(prompts[: len(prompts) // 2], GREEDY)
    second = llm.generate(prompts[len(prompts) // 2 :], GREEDY)
    return [output.token_ids for output in first + second], llm


@pytest.mark.parametrize(
    "config",
    [{}, {"max_num_seqs": 2}, {"kv_cache_memory_bytes": 10 * 8192}, {"max_num_batched_tokens": 24}],
    ids=["batched", "staggered", "preempting", "chunked"],
)
def test_greedy_outputs_are_the_same_with_prefix_caching_on_and_off(tiny_model, config):
    prompts = _workload(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    expected, _ = _run(tiny_model, prompts, enable_prefix_caching=False, **config)
    got, llm = _run(tiny_model, prompts, enable_prefix_caching=True, **config)
    assert got == expected
    scheduler = llm.engine.core.scheduler
    assert scheduler.prefix_cache_hit_tokens > 0
    assert llm.engine.kv_usage().num_used_blocks == 0  # every block free or cached and evictable
    assert scheduler.allocator.num_cached_blocks > 0


def test_hits_are_the_full_blocks_of_the_cached_prefix(tiny_checkpoints, vocab_size):
    llm = LLM(str(tiny_checkpoints["llama"]))
    scheduler = llm.engine.core.scheduler
    prefix = _tokens(vocab_size, 3 * BLOCK_SIZE + 5, seed=3)
    llm.generate([prefix], GREEDY)  # caches its 3 full prompt blocks (and 0 more: 53 + 8 - 1 < 64)
    assert (scheduler.prefix_cache_queried_tokens, scheduler.prefix_cache_hit_tokens) == (53, 0)

    llm.generate([prefix[:50] + _tokens(vocab_size, 20, seed=4)], GREEDY)
    assert (scheduler.prefix_cache_queried_tokens, scheduler.prefix_cache_hit_tokens) == (53 + 70, 48)


def test_a_fully_cached_prompt_still_computes_its_last_block_for_logits(tiny_checkpoints, vocab_size):
    llm = LLM(str(tiny_checkpoints["llama"]))
    scheduler = llm.engine.core.scheduler
    prompt = _tokens(vocab_size, 2 * BLOCK_SIZE, seed=5)  # exactly two blocks
    (first,) = llm.generate([prompt], GREEDY)
    (again,) = llm.generate([prompt], GREEDY)
    assert again.token_ids == first.token_ids
    assert scheduler.prefix_cache_hit_tokens == BLOCK_SIZE  # the block holding the last token is recomputed


def test_a_cache_salt_shares_blocks_within_the_salt_only(tiny_checkpoints, vocab_size):
    """Same prompt, different salts (or none): no shared block; same salt: the cached prefix is found. The tokens
    are the same either way."""
    llm = LLM(str(tiny_checkpoints["llama"]))
    engine, scheduler = llm.engine, llm.engine.core.scheduler
    prompt = _tokens(vocab_size, 3 * BLOCK_SIZE + 5, seed=6)

    def hits_of(salt: str | None) -> tuple[int, list[int]]:
        before = scheduler.prefix_cache_hit_tokens
        request_id = engine.add_request(prompt, GREEDY, cache_salt=salt)
        deltas = [delta for _ in range(64) if engine.has_unfinished() for delta in engine.step()]
        tokens = [token for delta in deltas if delta.request_id == request_id for token in delta.token_ids]
        return scheduler.prefix_cache_hit_tokens - before, tokens

    first_hits, expected = hits_of("tenant-a")
    assert first_hits == 0
    for salt, hits in [("tenant-b", 0), (None, 0), ("tenant-a", 3 * BLOCK_SIZE), (None, 3 * BLOCK_SIZE)]:
        assert hits_of(salt) == (hits, expected), salt


def test_aborting_one_holder_of_a_shared_prefix_leaves_the_other_unchanged(tiny_checkpoints, vocab_size):
    prefix = _tokens(vocab_size, 40, seed=6)
    prompts = [[*prefix, 5], [*prefix, 6]]
    (expected,) = LLM(str(tiny_checkpoints["llama"]), enable_prefix_caching=False).generate([prompts[1]], GREEDY)

    llm = LLM(str(tiny_checkpoints["llama"]))
    engine = llm.engine
    llm.generate([prompts[0]], GREEDY)  # caches the prefix blocks
    kept = engine.add_request(prompts[1], GREEDY)
    aborted = engine.add_request(prompts[0], GREEDY)
    released = engine.step()  # both hold the shared blocks now
    assert engine.core.scheduler.prefix_cache_hit_tokens >= 2 * 32
    engine.abort(aborted)
    while engine.has_unfinished():
        released += engine.step()
    assert RequestDelta.merge([d for d in released if d.request_id == kept]).token_ids == expected.token_ids
    assert engine.kv_usage().num_used_blocks == 0


# --- Allocator with cached blocks -----------------------------------------------------------------------------------


HASHER = BlockHasher()


def _key(i: int) -> BlockKey:
    return HASHER.key(None, (i, i + 1))


def test_a_freed_cached_block_is_found_again_until_an_allocation_evicts_it_least_recent_first():
    allocator = BlockAllocator(3)
    blocks = allocator.allocate(3)
    for block, i in zip(blocks, range(3), strict=True):
        allocator.register(block, _key(i))
    allocator.free([blocks[1]])
    allocator.free([blocks[0]])
    assert allocator.num_free_blocks == 2 and allocator.lookup(_key(1)) == blocks[1]
    (evicted,) = allocator.allocate(1)
    assert evicted == blocks[1]  # freed first, evicted first
    assert allocator.lookup(_key(1)) is None and allocator.lookup(_key(0)) == blocks[0]
    allocator.take_cached(blocks[0])
    assert allocator.ref_count(blocks[0]) == 1 and allocator.num_free_blocks == 0


def test_lookup_checks_the_parent_and_the_tokens_not_only_the_digest():
    allocator = BlockAllocator(2)
    (block,) = allocator.allocate(1)
    key = _key(1)
    allocator.register(block, key)
    # Forged keys carrying the registered digest: with SHA-256 no real key does, but a hit is verified anyway.
    other_tokens = BlockKey(key.parent_digest, (1, 3), None, key.digest)
    other_parent = BlockKey(_key(7).digest, key.token_ids, None, key.digest)
    other_extra = BlockKey(key.parent_digest, key.token_ids, cache_salt_keys("another tenant"), key.digest)
    assert all(allocator.lookup(forged) is None for forged in (other_tokens, other_parent, other_extra))
    assert allocator.lookup(HASHER.key(None, key.token_ids)) == block


def test_keys_chain_over_the_parent_so_one_changed_token_changes_every_later_key():
    first, changed_first = HASHER.key(None, (1, 2)), HASHER.key(None, (1, 3))
    assert HASHER.key(first, (5, 6)).digest != HASHER.key(changed_first, (5, 6)).digest
    assert HASHER.key(first, (5, 6)) == HASHER.key(HASHER.key(None, (1, 2)), (5, 6))


def test_a_cache_salt_or_another_seed_starts_its_own_chain():
    tokens = (1, 2)
    first_blocks = {
        HASHER.key(None, tokens).digest,
        HASHER.key(None, tokens, cache_salt_keys("a")).digest,
        HASHER.key(None, tokens, cache_salt_keys("b")).digest,
        BlockHasher("another seed").key(None, tokens).digest,
    }
    assert len(first_blocks) == 4
    assert cache_salt_keys(None) is None and cache_salt_keys("") is None  # no salt: vLLM's rule too


def test_registering_or_taking_an_unallocated_block_is_refused():
    allocator = BlockAllocator(2)
    with pytest.raises(DoubleFreeError):
        allocator.register(0, _key(0))
    with pytest.raises(DoubleFreeError):
        allocator.take_cached(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["allocate", "free", "register", "reuse"]), st.integers(0, 7)), max_size=60))
def test_allocator_invariants_hold_with_sharing_and_eviction(operations):
    allocator = BlockAllocator(6)
    holders: list[list[int]] = []
    for operation, n in operations:
        if operation == "allocate" and n % 4 <= allocator.num_free_blocks:
            holders.append(allocator.allocate(n % 4))
        elif operation == "free" and holders:
            allocator.free(holders.pop(n % len(holders)))
        elif operation == "register" and holders and holders[n % len(holders)]:
            held = holders[n % len(holders)]
            allocator.register(held[n % len(held)], _key(n))
        elif operation == "reuse":
            block = allocator.lookup(_key(n))
            if block is not None:
                allocator.take_cached(block)
                holders.append([block])
        held = [block for holder in holders for block in holder]
        for block in range(allocator.num_blocks):
            assert allocator.ref_count(block) == held.count(block)
        assert allocator.num_used_blocks == len(set(held))
        for key_index in range(8):
            block = allocator.lookup(_key(key_index))
            assert block is None or allocator._key_by_block[block] == _key(key_index)
    for holder in holders:
        allocator.free(holder)
    assert allocator.num_used_blocks == 0 and allocator.num_free_blocks == allocator.num_blocks
