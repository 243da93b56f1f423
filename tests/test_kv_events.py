"""KV-cache events: block hashes as vLLM computes them, the allocator's events, and the ZMQ publisher checked by a
subscriber written from the published format against the allocator, step by step."""

import hashlib
import threading
import time

import cbor2
import httpx
import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.kv_events import KVEventPublisher, KVEventsConfig
from kvserve.engine.stats import StatsTracker
from kvserve.kvcache import BlockAllocator, BlockHasher, cache_salt_keys
from kvserve.kvcache.block_hash import DEFAULT_HASH_SEED, block_hash, cbor_encode, low_64_bits, resolve_hash_seed
from kvserve.kvcache.events import AllBlocksCleared, BlocksRemoved, BlocksStored
from kvserve.scheduler import Scheduler, SchedulerConfig
from tests.kv_events_subscriber import AllBlocksCleared as ClearedEvent
from tests.kv_events_subscriber import BlockRemoved, BlockStored, Subscriber, index_of
from tests.server_harness import TINY_MODEL, tiny_server

BLOCK_SIZE = 16
KV_BYTES_PER_BLOCK = 8192  # the tiny Llama: 512 bytes a token
COMPLETIONS = "/v1/completions"


def _vllm_hash(parent: bytes, tokens, extra_keys) -> bytes:
    """vLLM's sha256_cbor, from its definition: SHA-256 of cbor2's canonical encoding of the key tuple."""
    return hashlib.sha256(cbor2.dumps((parent, tuple(tokens), extra_keys), canonical=True)).digest()


NONE_HASH = hashlib.sha256(cbor2.dumps(DEFAULT_HASH_SEED, canonical=True)).digest()


# --- Hashes -----------------------------------------------------------------------------------------------------


def test_block_hashes_equal_the_ones_vllm_computed():
    """Values printed by vLLM 0.32's own `hash_block_tokens(sha256_cbor, ...)` after `init_none_hash(sha256_cbor)`
    with PYTHONHASHSEED unset: blocks [1..16] and [17..32], and [1..16] under cache salt "tenant-a"."""
    hasher = BlockHasher()
    first = hasher.key(None, tuple(range(1, 17)))
    second = hasher.key(first, tuple(range(17, 33)))
    salted = hasher.key(None, tuple(range(1, 17)), cache_salt_keys("tenant-a"))
    assert first.digest.hex() == "cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682"
    assert second.digest.hex() == "2533ea50426b36e9e4d68296cac6bce8cf602e46957d0fe40b368b33d87bf3bf"
    assert salted.digest.hex() == "d4fdd9f3dab139eafd01550f43781481256e9531b59b55ea4656df8f49124fcf"
    assert low_64_bits(first.digest) == 8866452693264111234  # vLLM's maybe_convert_block_hash of the first


_TOKENS = st.lists(st.integers(0, 2**40), min_size=1, max_size=40).map(tuple)
_EXTRA = st.one_of(st.none(), st.text(max_size=300).map(lambda salt: (("cache_salt", salt),)))


@given(parent=st.binary(min_size=32, max_size=32), tokens=_TOKENS, extra=_EXTRA)
def test_the_encoder_writes_what_cbor2_writes_and_the_hash_follows(parent, tokens, extra):
    assert cbor_encode((parent, tokens, extra)) == cbor2.dumps((parent, tokens, extra), canonical=True)
    assert block_hash(parent, tokens, extra) == _vllm_hash(parent, tokens, extra)


def test_the_seed_is_the_configured_one_else_pythonhashseed_else_vllms_default():
    assert resolve_hash_seed("mine", {"PYTHONHASHSEED": "0"}) == "mine"
    assert resolve_hash_seed(None, {"PYTHONHASHSEED": "0"}) == "0"
    assert resolve_hash_seed(None, {}) == DEFAULT_HASH_SEED
    assert BlockHasher("0").key(None, (1,)).digest == _vllm_hash(hashlib.sha256(cbor2.dumps("0")).digest(), (1,), None)


# --- The allocator's events ---------------------------------------------------------------------------------------


def test_the_allocator_reports_stores_evictions_and_clears_merging_one_chains_stores():
    hasher = BlockHasher()
    allocator = BlockAllocator(3, record_events=True)
    blocks = allocator.allocate(3)
    first = hasher.key(None, (1, 2))
    second = hasher.key(first, (3, 4))
    other = hasher.key(None, (9, 9), cache_salt_keys("t"))
    allocator.register(blocks[0], first)
    allocator.register(blocks[1], second)
    allocator.register(blocks[2], other)
    allocator.register(blocks[2], other)  # already cached: nothing new
    assert allocator.take_events() == [
        BlocksStored((first.digest, second.digest), None, (1, 2, 3, 4), (None, None)),
        BlocksStored((other.digest,), None, (9, 9), ((("cache_salt", "t"),),)),
    ]
    assert allocator.take_events() == []
    allocator.free(blocks)
    assert allocator.take_events() == []  # freed blocks stay cached
    allocator.allocate(2)  # evicts the two least recently freed
    assert allocator.take_events() == [BlocksRemoved((first.digest, second.digest))]
    allocator.clear_cache()
    assert allocator.take_events() == [AllBlocksCleared()]
    assert allocator.cached_keys() == [] and allocator.num_free_blocks == 1


def test_an_allocator_without_events_keeps_none():
    allocator = BlockAllocator(2)
    (block,) = allocator.allocate(1)
    allocator.register(block, BlockHasher().key(None, (1,)))
    assert allocator.take_events() == []


# --- The publisher against the engine ----------------------------------------------------------------------------


def _endpoints(tmp_path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-events-replay"


def _prompts(num: int, salt_every: int = 0) -> list[tuple[list[int], str | None]]:
    """Prompts of 3-5 blocks sharing a 2-block system prefix; every `salt_every`-th one salted."""
    system = [7 + (11 * i) % 300 for i in range(2 * BLOCK_SIZE)]
    prompts = []
    for i in range(num):
        own = [20 + (13 * i + 5 * j) % 400 for j in range(BLOCK_SIZE * (1 + i % 3) + 5)]
        salt = f"tenant-{i % 2}" if salt_every and i % salt_every == 0 else None
        prompts.append((system + own, salt))
    return prompts


def _expected_hashes(allocator: BlockAllocator, as_int: bool) -> set:
    digests = [key.digest for key in allocator.cached_keys()]
    return {low_64_bits(digest) for digest in digests} if as_int else set(digests)


def _settle(subscriber: Subscriber, allocator: BlockAllocator, as_int: bool, timeout_s: float = 10.0) -> None:
    """Receive until the subscriber's index equals the allocator's cached blocks (failing after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    expected = _expected_hashes(allocator, as_int)
    while True:
        subscriber.receive(0.05)
        if not subscriber.payloads or subscriber.missing():  # joined late, or lost some: ask for them again
            subscriber.replay(subscriber.missing()[0] if subscriber.payloads else 0)
        if subscriber.payloads and index_of(subscriber.batches()) == expected:
            return
        assert time.monotonic() < deadline, f"index {index_of(subscriber.batches())} != allocator {expected}"


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int64-hashes", "bytes-hashes"])
def test_every_step_the_subscribers_index_equals_the_allocators_cache(tiny_checkpoints, tmp_path, int_hashes):
    endpoint, replay = _endpoints(tmp_path)
    subscriber = Subscriber(endpoint, replay)
    llm = LLM(
        str(tiny_checkpoints["llama"]),
        kv_cache_memory_bytes=24 * KV_BYTES_PER_BLOCK,  # small enough that later prompts evict earlier blocks
        kv_events_endpoint=endpoint,
        kv_events_replay_endpoint=replay,
        kv_events_topic="kv@pod-a@tiny",
        kv_events_int_hashes=int_hashes,
        max_num_seqs=3,
    )
    try:
        engine, allocator = llm.engine, llm.engine.core.scheduler.allocator
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        for prompt, salt in _prompts(8, salt_every=3):
            engine.add_request(prompt, params, cache_salt=salt)
        num_steps = 0
        while engine.has_unfinished():
            engine.step()
            num_steps += 1
            _settle(subscriber, allocator, int_hashes)
        batches = subscriber.batches()
    finally:
        llm.close()
        subscriber.close()
    events = [event for batch in batches for event in batch.events]
    assert isinstance(events[0], ClearedEvent)  # sequence 0: a fresh start
    assert any(isinstance(event, BlockRemoved) for event in events), "the workload was meant to evict"
    assert subscriber.topics == {b"kv@pod-a@tiny"}
    assert all(batch.data_parallel_rank == 0 and batch.ts > 0 for batch in batches)
    _check_hashes_from_tokens([event for event in events if isinstance(event, BlockStored)], int_hashes)


def _check_hashes_from_tokens(stored: list[BlockStored], as_int: bool) -> None:
    """Each stored block's hash is what vLLM's scheme gives its tokens after its parent (recomputed with cbor2)."""
    digest_of = {}  # published hash -> full digest, for parents
    for event in stored:
        assert event.block_size == BLOCK_SIZE and event.medium == "CPU" and event.lora_name is None
        assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes) == BLOCK_SIZE * len(event.extra_keys)
        parent = NONE_HASH if event.parent_block_hash is None else digest_of[event.parent_block_hash]
        for index, published in enumerate(event.block_hashes):
            tokens = event.token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
            extra = event.extra_keys[index]
            tagged = None if extra is None else tuple(("cache_salt", salt) for salt in extra)
            assert tagged is None or (index == 0 and event.parent_block_hash is None)  # salts on first blocks only
            parent = _vllm_hash(parent, tokens, tagged)
            assert published == (low_64_bits(parent) if as_int else parent)
            digest_of[published] = parent
    assert any(event.extra_keys[0] for event in stored), "some prompts were salted"


def test_a_late_subscriber_gets_everything_from_the_replay_socket(tiny_checkpoints, tmp_path):
    endpoint, replay = _endpoints(tmp_path)
    with LLM(str(tiny_checkpoints["llama"]), kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay) as llm:
        llm.generate([prompt for prompt, _ in _prompts(3)], SamplingParams(max_tokens=4, temperature=0.0))
        cached = _expected_hashes(llm.engine.core.scheduler.allocator, as_int=True)
        subscriber = Subscriber(endpoint, replay)  # joins after everything was published
        try:
            deadline = time.monotonic() + 10
            while index_of(_replayed(subscriber)) != cached:
                assert time.monotonic() < deadline, "the replay never covered the cache"
        finally:
            subscriber.close()


def _replayed(subscriber: Subscriber):
    subscriber.replay(0)
    assert min(subscriber.payloads) == 0
    return subscriber.batches()


def test_the_array_format_is_the_positional_one_older_consumers_decode(tiny_checkpoints, tmp_path):
    """vLLM's encoding before it dropped array_like, field by field as llm-d's decoder for it reads them."""
    endpoint, replay = _endpoints(tmp_path)
    with LLM(
        str(tiny_checkpoints["llama"]), kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay,
        kv_events_format="array",
    ) as llm:  # fmt: skip
        llm.generate([prompt for prompt, _ in _prompts(2)], SamplingParams(max_tokens=4, temperature=0.0))
        subscriber = Subscriber(endpoint, replay)
        try:
            subscriber.replay(0)
            batches = [msgpack.unpackb(subscriber.payloads[seq]) for seq in sorted(subscriber.payloads)]
        finally:
            subscriber.close()
    assert batches[0][1] == [["AllBlocksCleared"]]
    stored = [event for batch in batches for event in batch[1] if event[0] == "BlockStored"]
    assert stored
    for _, hashes, parent, tokens, block_size, lora_id, medium, lora_name in stored:
        assert all(isinstance(value, int) for value in hashes) and (parent is None or isinstance(parent, int))
        assert len(tokens) == block_size * len(hashes) and (lora_id, medium, lora_name) == (None, "CPU", None)


# --- Never blocking the engine -------------------------------------------------------------------------------------


class _StuckPublisher(KVEventPublisher):
    """A publisher whose sending thread is stuck (a subscriber that never reads, a network that never drains)."""

    def __init__(self, *args, **kwargs) -> None:
        self.unstick = threading.Event()
        self.stuck = threading.Event()
        super().__init__(*args, **kwargs)

    def _send(self, seq, timestamp, events) -> None:
        self.stuck.set()
        self.unstick.wait()
        super()._send(seq, timestamp, events)


def test_a_full_queue_drops_and_counts_instead_of_waiting_and_leaves_a_gap(tmp_path):
    endpoint, replay = _endpoints(tmp_path)
    config = KVEventsConfig(endpoint, BLOCK_SIZE, "CPU", replay_endpoint=replay, queue_size=2)
    publisher = _StuckPublisher(config)
    subscriber = Subscriber(endpoint, replay)
    try:
        event = BlocksRemoved((bytes(32),) * 3)
        # Only once the thread holds the start-up batch is the queue's count of free places known.
        assert publisher.stuck.wait(timeout=10)
        start_s = time.monotonic()
        for _ in range(10):
            publisher.publish([event, event])
        assert time.monotonic() - start_s < 0.5  # no step waited on the socket
        # The thread holds the start-up batch, the queue two more: the other eight steps' events were dropped.
        assert publisher.num_dropped_events == 16
        publisher.unstick.set()
        _replay_until(subscriber, 2)  # the queue has drained
        publisher.publish([event])
        _replay_until(subscriber, 11)
        # The dropped batches kept their sequence numbers: a subscriber sees the gap.
        assert sorted(subscriber.payloads) == [0, 1, 2, 11] and subscriber.missing() == list(range(3, 11))
    finally:
        publisher.unstick.set()
        publisher.close()
        subscriber.close()


def _replay_until(subscriber: Subscriber, seq: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while seq not in subscriber.payloads:
        assert time.monotonic() < deadline, f"batch {seq} never came"
        subscriber.replay(0)
        time.sleep(0.01)


def test_dropped_events_reach_the_stats_as_what_changed_since_the_last_collect():
    tracker, scheduler = StatsTracker(), Scheduler(SchedulerConfig(), BlockAllocator(4), BLOCK_SIZE)
    assert tracker.collect(scheduler.stats(), None, 5).num_dropped_kv_events == 5
    assert tracker.collect(scheduler.stats(), None, 5).num_dropped_kv_events == 0
    assert tracker.collect(scheduler.stats(), None, 12).num_dropped_kv_events == 7


# --- Settings ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"kv_events_replay_endpoint": "tcp://*:5558"}, "kv_events_replay_endpoint"),
        ({"kv_events_endpoint": "tcp://*:5557", "enable_prefix_caching": False}, "enable_prefix_caching"),
        ({"kv_events_endpoint": "tcp://*:5557", "kv_events_queue_size": 0}, "kv_events_queue_size"),
        ({"kv_events_endpoint": "tcp://*:5557", "kv_events_format": "json"}, "kv_events_format"),
    ],
)
def test_inconsistent_event_settings_are_refused_by_name(overrides, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(**overrides)


def test_an_endpoint_that_cannot_be_opened_is_named(tmp_path):
    config = KVEventsConfig(endpoint="tcp://*:notaport", block_size=BLOCK_SIZE, medium="CPU")
    with pytest.raises(ValueError, match="tcp://\\*:notaport"):
        KVEventPublisher(config)


# --- A served replica -------------------------------------------------------------------------------------------------


def test_a_server_publishes_its_cache_and_counts_drops_in_metrics(tiny_checkpoints, tmp_path):
    endpoint, replay = _endpoints(tmp_path)
    settings = {"kv_events_endpoint": endpoint, "kv_events_replay_endpoint": replay, "kv_events_topic": "kv@a@tiny"}
    with tiny_server(tiny_checkpoints, **settings) as server:
        prompt = " ".join(["the"] * 60)
        for _ in range(2):
            response = httpx.post(server.base_url + COMPLETIONS, json={"model": TINY_MODEL, "prompt": prompt,
                                                                       "max_tokens": 2}, timeout=30)  # fmt: skip
            assert response.status_code == 200
        server.wait_until_idle()
        subscriber = Subscriber(endpoint, replay)
        try:
            _settle(subscriber, server.engine.core.scheduler.allocator, as_int=True)
        finally:
            subscriber.close()
        assert subscriber.topics == {b"kv@a@tiny"}
        metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert f'kvserve:kv_events_dropped_total{{model_name="{TINY_MODEL}"}} 0.0' in metrics


def test_blocks_of_a_lora_adapter_carry_its_name_id_and_key(tiny_checkpoints, tmp_path):
    """As vLLM: ("lora", name, path) in every block's key (before the first block's salt), published untagged, and
    the adapter's name and id in the event."""
    from kvserve.testing.lora_adapters import write_peft_adapter

    model_dir = tiny_checkpoints["llama"]
    adapter = write_peft_adapter(model_dir, tmp_path / "adapter", seed=0, r=4, target_modules=["q_proj"])
    endpoint, replay = _endpoints(tmp_path)
    subscriber = Subscriber(endpoint, replay)
    settings = {"enable_lora": True, "lora_modules": (("tenant-lora", str(adapter)),)}
    try:
        with LLM(str(model_dir), kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay, **settings) as llm:
            llm.engine.add_request(list(range(5, 45)), SamplingParams(max_tokens=1), cache_salt="s",
                                   lora_name="tenant-lora")  # fmt: skip
            while llm.engine.has_unfinished():
                llm.engine.step()
            _settle(subscriber, llm.engine.core.scheduler.allocator, as_int=True)
        (event,) = [e for batch in subscriber.batches() for e in batch.events if isinstance(e, BlockStored)]
    finally:
        subscriber.close()
    assert (event.lora_name, event.lora_id) == ("tenant-lora", 1)
    assert event.extra_keys == [["tenant-lora", "s"], ["tenant-lora"]]  # msgpack sends tuples as arrays
    lora_key = ("lora", "tenant-lora", str(adapter))
    first = _vllm_hash(NONE_HASH, range(5, 21), (lora_key, ("cache_salt", "s")))
    assert event.block_hashes == [low_64_bits(first), low_64_bits(_vllm_hash(first, range(21, 37), (lora_key,)))]
