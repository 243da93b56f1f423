"""GET /v1/engine/state, the console's snapshot: the block map against the allocator, the requests' blocks against
the scheduler, the live figures against the step stats they come from; and how they get to a client."""

import base64
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.engine import EngineConfig, LLMEngine, SamplingParams
from kvserve.engine import async_engine as async_engine_module
from kvserve.engine.engine_state import WINDOW_S, StatsWindow, take_engine_state
from kvserve.engine.stats import SpecDecodeCounts, StepStats
from kvserve.kvcache import BlockAllocator, BlockHasher, BlockKey, KVUsage
from kvserve.kvcache.block_map import BlockState, block_ranges, build_block_map, encode_states, run_lengths
from kvserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from kvserve.server.protocol import EngineStateResponse
from kvserve.testing.fault_injection import FaultPlan, FaultyExecute
from tests.server_harness import TINY_MODEL, assert_openai_error, slow_down_steps, tiny_server, wait_for

BLOCK_SIZE = 16
API_KEY = "console-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PREFIX = [5 + (7 * i) % 400 for i in range(5 * BLOCK_SIZE)]  # five full blocks two prompts share


def _key(i: int) -> BlockKey:
    return BlockHasher().key(None, (i,))


def _expand(ranges) -> list[int]:
    return [block_id for start, end in ranges for block_id in range(start, end)]


def _decode_states(kv_cache: dict) -> bytes:
    if kv_cache["encoding"] == "base64":
        return base64.b64decode(kv_cache["states"])
    return b"".join(bytes([state]) * length for state, length in kv_cache["states"])


def _stats(**fields) -> StepStats:
    defaults = dict(
        num_running=0, num_waiting=0, num_preempted_waiting=0, kv_usage=KVUsage(100, 0, 0, BLOCK_SIZE),
        num_batched_requests=0, num_batched_tokens=0, num_prompt_tokens=0, num_generation_tokens=0, num_preemptions=0,
        prefix_cache_queried_tokens=0, prefix_cache_hit_tokens=0,
    )  # fmt: skip
    return StepStats(**{**defaults, **fields})


# --- The block map, from an allocator alone ---------------------------------------------------------------------


def test_each_block_shows_free_held_shared_or_evictable_and_shared_blocks_their_ref_counts():
    allocator = BlockAllocator(8)
    held = allocator.allocate(4)  # 0..3
    allocator.register(held[0], _key(0))
    allocator.fork(held[:2])
    allocator.fork(held[:1])  # block 0: 3 holders, block 1: 2
    allocator.register(held[3], _key(3))
    allocator.free([held[2], held[3]])  # 2: nothing worth keeping; 3: cached, held by nobody

    block_map = build_block_map(allocator)

    F, H, S, E = BlockState.FREE, BlockState.HELD, BlockState.SHARED, BlockState.EVICTABLE
    assert block_map.states == bytes([S, S, F, E, F, F, F, F])
    assert block_map.shared == ((0, 3), (1, 2))
    assert block_map.num_used_blocks == allocator.num_used_blocks == 2
    assert block_map.count(F) + block_map.count(E) == allocator.num_free_blocks
    allocator.free(held[1:2])
    assert build_block_map(allocator).states[:2] == bytes([S, H])


def test_block_ranges_are_the_runs_of_consecutive_ids_in_table_order():
    assert block_ranges([]) == ()
    assert block_ranges([7]) == ((7, 8),)
    assert block_ranges([0, 1, 2, 9, 10, 4, 3]) == ((0, 3), (9, 11), (4, 5), (3, 4))
    assert _expand(block_ranges([0, 1, 2, 9, 10, 4, 3])) == [0, 1, 2, 9, 10, 4, 3]


@pytest.mark.parametrize(
    ("states", "encoding"),
    [(bytes(1000), "rle"), (bytes([1] * 40 + [0] * 960), "rle"), (bytes(i % 4 for i in range(1000)), "base64")],
    ids=["all free", "one run held", "alternating"],
)
def test_states_go_as_the_shorter_of_base64_and_runs_and_decode_to_the_same_bytes(states, encoding):
    sent_encoding, sent = encode_states(states)
    assert sent_encoding == encoding
    assert _decode_states({"encoding": sent_encoding, "states": sent}) == states
    both = (json.dumps(base64.b64encode(states).decode()), json.dumps(run_lengths(states)))
    assert len(json.dumps(sent)) == min(map(len, both))


# --- Live figures, from StepStats --------------------------------------------------------------------------------


def test_latency_percentiles_are_those_of_the_reported_latencies_within_a_bucket():
    window = StatsWindow()
    latencies = [0.001 * (i + 1) for i in range(1000)]  # 1 ms .. 1 s
    for second in range(10):  # spread over ten seconds, the last one still filling
        chunk = latencies[second * 100 : (second + 1) * 100]
        window.record(_stats(inter_token_latency_s=chunk, time_to_first_token_s=chunk[:1]), 100.0 + second)

    figures = window.figures(109.5)

    itl = figures.inter_token_latency_s
    assert itl.count == 1000
    for reported, exact in ((itl.p50, 0.5), (itl.p90, 0.9), (itl.p99, 0.99)):
        assert reported == pytest.approx(exact, rel=0.02)
    assert figures.time_to_first_token_s.count == 10
    assert StatsWindow().figures(0.0).time_to_first_token_s is None


def test_series_hold_one_sample_a_second_and_an_idle_second_keeps_the_last_queues_and_usage():
    window = StatsWindow()
    usage = KVUsage(100, 25, 300, BLOCK_SIZE)
    window.record(_stats(num_running=3, num_waiting=2, num_generation_tokens=30, kv_usage=usage), 1000.2)
    window.record(_stats(num_running=2, num_waiting=1, num_generation_tokens=20, kv_usage=usage), 1000.7)
    window.record(_stats(num_running=1, num_preemptions=1, num_generation_tokens=10), 1003.1)

    figures = window.figures(1004.5)

    assert all(len(series) == WINDOW_S for series in (figures.num_running, figures.kv_usage, figures.num_preemptions))
    assert figures.num_running[-5:] == (2, 2, 2, 1, 1)  # seconds 1000..1004: last of 1000, carried over idle ones
    assert figures.num_waiting[-5:] == (1, 1, 1, 0, 0)
    assert figures.kv_usage[-5:] == (0.25, 0.25, 0.25, 0.0, 0.0)
    assert figures.num_output_tokens[-5:] == (50, 0, 0, 10, 0)
    assert figures.num_preemptions[-5:] == (0, 0, 0, 1, 0)
    assert figures.output_tokens_per_s == pytest.approx(60 / 9.5)  # nine whole seconds and half of this one
    assert figures.num_running[0] == 0  # before anything was reported


def test_the_speculation_figure_is_the_mean_tokens_a_verifying_step_gave_within_the_window():
    window = StatsWindow()
    window.record(_stats(), 500.0)
    assert window.figures(500.5).spec_acceptance_length is None  # no drafts verified
    window.record(_stats(spec_decode=SpecDecodeCounts(num_drafts=4, num_draft_tokens=16, num_accepted_tokens=6)), 501.0)
    window.record(_stats(spec_decode=SpecDecodeCounts(num_drafts=2, num_draft_tokens=8, num_accepted_tokens=6)), 502.0)
    assert window.figures(502.5).spec_acceptance_length == 1 + 12 / 6
    assert window.figures(501.0 + WINDOW_S + 0.5).spec_acceptance_length == 1 + 6 / 2  # the first left the window


def test_a_second_leaves_the_window_a_minute_later_and_its_queues_carry_on():
    window = StatsWindow()
    window.record(_stats(num_running=4, num_generation_tokens=7, inter_token_latency_s=[0.01]), 1000.0)
    assert window.figures(1000.0 + WINDOW_S - 1).num_output_tokens[0] == 7

    figures = window.figures(1000.0 + WINDOW_S)

    assert sum(figures.num_output_tokens) == 0 and figures.inter_token_latency_s is None
    assert figures.num_running == (4,) * WINDOW_S


# --- Against the engine --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_checkpoints) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), kv_cache_memory_bytes=4 << 20, max_num_seqs=2))


def _snapshot(engine: LLMEngine):
    return take_engine_state(engine.core.scheduler, StatsWindow(), time.monotonic(), time.time())


def _check_against_the_engine(state, engine: LLMEngine) -> None:
    """What every snapshot must agree with: the allocator's counts and ref counts, the scheduler's requests."""
    allocator, scheduler = engine.core.scheduler.allocator, engine.core.scheduler
    block_map = state.block_map
    assert block_map.num_blocks == allocator.num_blocks
    assert block_map.num_used_blocks == allocator.num_used_blocks
    assert block_map.count(BlockState.FREE) + block_map.count(BlockState.EVICTABLE) == allocator.num_free_blocks
    for block_id, state_byte in enumerate(block_map.states):
        refs = allocator.ref_count(block_id)
        assert (state_byte == BlockState.SHARED) == (refs > 1) and (state_byte == BlockState.HELD) == (refs == 1)
    ref_counts = [allocator.ref_count(block_id) for block_id in range(allocator.num_blocks)]
    assert block_map.shared == tuple((block_id, refs) for block_id, refs in enumerate(ref_counts) if refs > 1)
    assert [row.request_id for row in state.running] == [request.request_id for request in scheduler.running]
    for row, request in zip(state.running, scheduler.running, strict=True):
        assert _expand(row.block_ranges) == request.block_ids
        assert row.num_computed_tokens == request.num_computed_tokens
        assert row.num_unfilled_slots == len(request.block_ids) * BLOCK_SIZE - request.num_computed_tokens
        assert row.num_unfilled_slots == -request.num_computed_tokens % BLOCK_SIZE  # only the last block's tail
        assert row.priority == request.priority
    assert state.num_waiting == len(scheduler.waiting)
    assert sum(count for _, count in state.waiting_by_priority) == state.num_waiting
    num_held_slots = allocator.num_used_blocks * BLOCK_SIZE
    unfilled = sum(row.num_unfilled_slots for row in state.running)
    assert state.fragmentation == (unfilled / num_held_slots if num_held_slots else 0.0)
    assert state.kv_usage == scheduler.kv_usage()


def test_two_requests_sharing_a_prefix_share_its_blocks_and_leave_them_cached_and_evictable(engine):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = engine.add_request([*PREFIX, 1, 2, 3], params)
    engine.step()  # prefills the first: its five full blocks are cached
    second = engine.add_request([*PREFIX, 4, 5], params)
    waiting = engine.add_request([7, 8, 9], params)  # max_num_seqs=2: it waits
    engine.step()
    requests = [engine.core.scheduler.get(request_id) for request_id in (first, second)]

    state = _snapshot(engine)

    _check_against_the_engine(state, engine)
    prefix_blocks = requests[0].block_ids[:5]
    assert requests[1].block_ids[:5] == prefix_blocks
    assert state.block_map.shared == tuple((block_id, 2) for block_id in sorted(prefix_blocks))
    own_blocks = requests[0].block_ids[5:] + requests[1].block_ids[5:]
    assert all(state.block_map.states[block_id] == BlockState.HELD for block_id in own_blocks)
    assert state.num_waiting == 1 and state.num_preempted_waiting == 0
    assert state.prefix_cache_hit_rate == 80 / (83 + 82)  # the second found the prefix

    engine.abort(waiting)
    while engine.has_unfinished():
        engine.step()
    state = _snapshot(engine)

    _check_against_the_engine(state, engine)
    cached = {engine.core.scheduler.allocator.lookup(key) for request in requests for key in request.block_keys}
    evictable = {block_id for block_id, byte in enumerate(state.block_map.states) if byte == BlockState.EVICTABLE}
    assert evictable == cached - {None} and set(prefix_blocks) <= evictable
    assert len(evictable) == engine.core.scheduler.allocator.num_cached_blocks
    assert state.block_map.num_used_blocks == 0 and state.block_map.shared == () and state.running == ()
    assert state.fragmentation == 0.0


def test_a_snapshot_of_100k_blocks_and_256_requests_costs_milliseconds_of_the_engine_thread():
    """Not a timed assertion: prints what one snapshot costs (engine thread) and one response (event loop)."""
    allocator = BlockAllocator(100_000)
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, watermark_blocks=0,
                             enable_chunked_prefill=True, enable_prefix_caching=True)  # fmt: skip
    scheduler = Scheduler(config, allocator, BLOCK_SIZE)
    prefix = allocator.allocate(32)  # a 512-token system prompt every request shares
    cached = allocator.allocate(4000)  # then 4000 blocks that finished requests left in the cache
    for i, block_id in enumerate(prefix + cached):
        allocator.register(block_id, _key(i))
    allocator.free(cached)
    allocator.fork(prefix * 255)
    for i in range(256):
        block_ids = prefix + allocator.allocate(360)
        num_tokens = len(block_ids) * BLOCK_SIZE - i % BLOCK_SIZE
        request = Request(f"request-{i}", [1] * (num_tokens - 100), [2] * 100, num_tokens, block_ids,
                          RequestStatus.RUNNING)  # fmt: skip
        scheduler.running.append(request)
    window = StatsWindow()
    for step in range(40 * WINDOW_S):  # a minute at 40 steps a second, 256 decodes each
        window.record(_stats(num_running=256, num_generation_tokens=256, inter_token_latency_s=[0.02] * 256), step / 40)

    timings_ms, responses_ms = [], []
    for _ in range(5):
        start_s = time.perf_counter()
        state = take_engine_state(scheduler, window, WINDOW_S, time.time())
        timings_ms.append((time.perf_counter() - start_s) * 1e3)
        start_s = time.perf_counter()
        body = EngineStateResponse.of(state, age_s=0.0).model_dump_json()
        responses_ms.append((time.perf_counter() - start_s) * 1e3)

    assert state.block_map.count(BlockState.SHARED) == 32 and state.block_map.shared[0] == (prefix[0], 256)
    assert state.block_map.count(BlockState.EVICTABLE) == 4000 and len(state.running) == 256
    print(
        f"\n100k blocks, 256 requests ({allocator.num_used_blocks} blocks held): snapshot {min(timings_ms):.1f} ms "
        f"(median {sorted(timings_ms)[2]:.1f}) on the engine thread; response {min(responses_ms):.1f} ms, "
        f"{len(body)} bytes of JSON"
    )


# --- Through the server ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def protected(tiny_checkpoints):
    with tiny_server(tiny_checkpoints, api_key=API_KEY) as running:
        yield running


@pytest.fixture
def fresh_snapshots(monkeypatch):
    """Every GET takes a new snapshot (instead of one a second), so a test sees the state right after its step."""
    monkeypatch.setattr(async_engine_module, "STATE_MAX_AGE_S", 0.0)


def _get_state(running, headers=AUTH) -> dict:
    response = httpx.get(running.base_url + "/v1/engine/state", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    EngineStateResponse.model_validate(response.json())
    return response.json()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}], ids=["no key", "wrong key"])
def test_the_state_needs_the_api_key(protected, headers):
    response = httpx.get(protected.base_url + "/v1/engine/state", headers=headers)
    error = assert_openai_error(response, 401)
    assert error["code"] == "invalid_api_key"


def test_polls_within_a_second_get_the_same_snapshot_and_its_age(protected):
    first, second = _get_state(protected), _get_state(protected)
    assert first["taken_at"] == second["taken_at"] or second["taken_at"] > first["taken_at"] + 0.9
    assert 0 <= second["age_s"] <= 1.0 + async_engine_module.STATE_WAIT_S
    assert abs(second["taken_at"] + second["age_s"] - time.time()) < 1.0


def test_after_a_known_workload_the_state_matches_the_engine_and_the_figures_its_tokens(
    tiny_checkpoints, fresh_snapshots
):
    with tiny_server(tiny_checkpoints) as running:
        for prompt in (PREFIX, PREFIX[:40]):
            body = {"model": TINY_MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True}
            assert httpx.post(running.base_url + "/v1/completions", json=body, timeout=30).status_code == 200
        running.wait_until_idle()

        state = _get_state(running, headers={})

        allocator = running.engine.core.scheduler.allocator
        kv_cache, blocks = state["kv_cache"], state["kv_cache"]["blocks"]
        states = _decode_states(kv_cache)
        assert len(states) == blocks["total"] == allocator.num_blocks
        assert [states.count(i) for i in range(4)] == [blocks[name] for name in kv_cache["state_names"]]
        assert blocks["used"] == allocator.num_used_blocks == 0 and blocks["available"] == allocator.num_free_blocks
        assert blocks["evictable"] == allocator.num_cached_blocks == 5  # the first prompt's full blocks
        assert kv_cache["prefix_cache_hit_rate"] == 32 / (80 + 40)  # the second found two of them
        assert state["requests"] == {
            "running": [], "num_waiting": 0, "num_preempted_waiting": 0, "waiting_by_priority": []
        }  # fmt: skip
        live = state["live"]
        assert sum(live["num_output_tokens"]) == 10 and live["output_tokens_per_s"] > 0
        assert live["time_to_first_token_s"]["count"] == 2 and live["inter_token_latency_s"]["count"] == 8
        assert live["kv_usage"][-1] == 0.0
        assert live["prefix_cache_hit_rate"] == kv_cache["prefix_cache_hit_rate"]


def test_two_running_streams_sharing_a_prefix_show_its_blocks_shared_by_two_then_evictable(
    protected, fresh_snapshots, monkeypatch
):
    slow_down_steps(protected, monkeypatch)
    with httpx.Client(base_url=protected.base_url, headers=AUTH, timeout=30) as client:

        def stream(prompt):
            body = {"model": TINY_MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
            return client.stream("POST", "/v1/completions", json=body)

        with stream([*PREFIX, 1, 2, 3]) as first:
            first_lines = first.iter_lines()  # kept: a dropped iterator closes the connection, which aborts
            next(first_lines)  # its first token: the prefix is computed and cached
            with stream([*PREFIX, 4, 5]) as second:
                second_lines = second.iter_lines()
                next(second_lines)
                state = _get_state(protected)
        running = state["requests"]["running"]

        assert len(running) == 2
        prefix_blocks = _expand(running[0]["block_ranges"])[:5]
        assert _expand(running[1]["block_ranges"])[:5] == prefix_blocks
        assert state["kv_cache"]["shared"] == [[block_id, 2] for block_id in sorted(prefix_blocks)]
        states = _decode_states(state["kv_cache"])
        for row in running:
            own_blocks = _expand(row["block_ranges"])[5:]
            assert all(states[block_id] == BlockState.HELD for block_id in own_blocks)
            assert len(own_blocks) * BLOCK_SIZE - row["num_unfilled_slots"] == row["num_computed_tokens"] - 80
        unfilled = sum(row["num_unfilled_slots"] for row in running)
        blocks = state["kv_cache"]["blocks"]
        assert state["kv_cache"]["fragmentation"] == pytest.approx(unfilled / (blocks["used"] * BLOCK_SIZE))
        assert blocks["shared"] == 5 and blocks["held"] == blocks["used"] - 5

    protected.wait_until_idle()  # the clients left: both requests were aborted
    wait_for(lambda: _get_state(protected)["kv_cache"]["blocks"]["used"] == 0)
    states = _decode_states(_get_state(protected)["kv_cache"])
    assert all(states[block_id] == BlockState.EVICTABLE for block_id in prefix_blocks)


def test_while_a_step_hangs_a_poll_gets_the_snapshot_from_before_it_and_how_old_it_is(
    protected, fresh_snapshots, monkeypatch
):
    monkeypatch.setattr(async_engine_module, "STATE_WAIT_S", 0.2)
    hang = FaultyExecute(protected.engine.core.runner.execute, FaultPlan("hang", 0))
    monkeypatch.setattr(protected.engine.core.runner, "execute", hang)
    before = _get_state(protected)
    body = {"model": TINY_MODEL, "prompt": PREFIX, "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        completion = pool.submit(httpx.post, protected.base_url + "/v1/completions", json=body, headers=AUTH)
        wait_for(lambda: protected.engine.core.scheduler.running)  # scheduled: its step is under way, and hangs

        during = _get_state(protected)

        assert during["taken_at"] == before["taken_at"] and during["age_s"] >= 0.2
        assert during["requests"]["running"] == []
        hang.release()
        assert completion.result(timeout=30).status_code == 200
    assert _get_state(protected)["taken_at"] > before["taken_at"]
