"""The server under load, over loopback: an abort storm (clients vanishing at random points) and KV-cache exhaustion.

Both print their figures with `pytest -s tests/test_server_load.py`. Every loop is bounded in count and time.
"""

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from kvserve.engine import LLM, SamplingParams
from kvserve.scheduler import FinishReason
from tests.server_harness import TINY_MODEL, RunningServer, assert_nothing_allocated, slow_down_steps, tiny_server

COMPLETIONS = "/v1/completions"
ABORT_STORM_REQUESTS = 1000
STORM_CONCURRENCY = 64  # twice max_num_seqs, so requests queue
STORM_MAX_NUM_SEQS = 32
PREFILL_CHUNK_TOKENS = 8
STORM_TIMEOUT_S = 300
LONG_PROMPT_TOKENS = 400  # prefilled in 8-token chunks: 50 steps
BEHAVIOURS = ("queued", "prefill", "decode", "mid-stream", "complete")


@dataclass
class StormReport:
    """What the clients did and what the engine saw."""

    client_behaviours: Counter = field(default_factory=Counter)
    engine_aborts: Counter = field(default_factory=Counter)  # by the phase the request was in when aborted
    completed: int = 0
    unexpected: list[str] = field(default_factory=list)  # statuses or errors a client did not expect


def phase_of(running: RunningServer, request_id: str) -> str:
    """Where the engine holds a request: queued (waiting or preempted), prefill, decode, or gone (finished)."""
    scheduler = running.engine.core.scheduler
    if any(request.request_id == request_id for request in scheduler.waiting):
        return "queued"
    for request in scheduler.running:
        if request.request_id == request_id:
            return "prefill" if request.num_computed_tokens < len(request.prompt_token_ids) else "decode"
    return "gone"


def record_engine_aborts(running: RunningServer, monkeypatch, report: StormReport) -> None:
    core = running.engine.core
    finish = core.finish

    def recording_finish(request_id: str, reason: FinishReason = FinishReason.ABORT):
        if reason is FinishReason.ABORT:  # the engine thread: no race with the scheduler
            report.engine_aborts[phase_of(running, request_id)] += 1
        return finish(request_id, reason)

    monkeypatch.setattr(core, "finish", recording_finish)


async def one_client(client: httpx.AsyncClient, behaviour: str, rng: random.Random, report: StormReport) -> None:
    """One request that leaves at a random point of `behaviour`'s phase (or, for "complete", runs to the end)."""
    body = {"model": TINY_MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    try:
        if behaviour == "mid-stream":
            async with client.stream("POST", COMPLETIONS, json={**body, "stream": True}) as response:
                num_events, leave_after = 0, rng.randint(1, 20)
                async for line in response.aiter_lines():
                    num_events += line.startswith("data: ")
                    if num_events >= leave_after:
                        return  # closing the unread stream closes the connection
            return
        if behaviour == "complete":
            response = await client.post(COMPLETIONS, json={**body, "max_tokens": 8})
            if response.status_code == 200:
                report.completed += 1
            else:
                report.unexpected.append(f"complete: {response.status_code}")
            return
        if behaviour == "prefill":
            # Random tokens: a prompt the prefix cache has not seen is prefilled whole. Streamed, so the server
            # sees the client leave at once (a non-streamed request's disconnect is polled every 0.25 s).
            prompt = [rng.randrange(4, 500) for _ in range(LONG_PROMPT_TOKENS)]
            body = {**body, "prompt": prompt, "max_tokens": 50, "stream": True}
        leave_after_s = {"queued": rng.uniform(0, 0.005), "prefill": rng.uniform(0.05, 1.0),
                         "decode": rng.uniform(0.02, 0.3)}[behaviour]  # fmt: skip
        await asyncio.wait_for(read_all(client, body), leave_after_s)
    except TimeoutError:
        pass  # the client left: wait_for cancelled the request and httpx dropped its connection
    except httpx.HTTPError as error:
        report.unexpected.append(f"{behaviour}: {type(error).__name__}")


async def read_all(client: httpx.AsyncClient, body: dict) -> None:
    async with client.stream("POST", COMPLETIONS, json=body) as response:
        await response.aread()


async def abort_storm(base_url: str, num_requests: int, seed: int, report: StormReport) -> None:
    rng = random.Random(seed)
    slots = asyncio.Semaphore(STORM_CONCURRENCY)
    limits = httpx.Limits(max_connections=STORM_CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:

        async def run(behaviour: str) -> None:
            async with slots:
                await one_client(client, behaviour, rng, report)

        behaviours = [rng.choice(BEHAVIOURS) for _ in range(num_requests)]
        report.client_behaviours.update(behaviours)
        await asyncio.wait_for(asyncio.gather(*(run(b) for b in behaviours)), STORM_TIMEOUT_S)


def test_an_abort_storm_leaves_every_kv_block_free_and_the_server_serving(tiny_checkpoints, monkeypatch):
    num_requests = ABORT_STORM_REQUESTS
    settings = {"max_num_seqs": STORM_MAX_NUM_SEQS, "max_prefill_chunk_tokens": PREFILL_CHUNK_TOKENS}
    with tiny_server(tiny_checkpoints, **settings) as running:
        slow_down_steps(running, monkeypatch)  # so each phase lasts long enough to be left in, on any machine
        report = StormReport()
        record_engine_aborts(running, monkeypatch, report)
        start_s = time.monotonic()
        asyncio.run(abort_storm(running.base_url, num_requests, seed=num_requests, report=report))
        running.wait_until_idle(timeout_s=60)
        usage = running.engine.kv_usage()
        print(
            f"\nabort storm: {num_requests} requests in {time.monotonic() - start_s:.1f} s; clients "
            f"{dict(report.client_behaviours)}; engine aborts by phase {dict(report.engine_aborts)}; "
            f"{report.completed} completed; {usage.num_used_blocks} of {usage.num_total_blocks} KV blocks held after"
        )

        assert report.unexpected == []
        assert report.completed == report.client_behaviours["complete"]
        # Requests were caught in every phase (a "gone" one had finished before its abort arrived).
        assert {"queued", "prefill", "decode"} <= set(report.engine_aborts)
        assert_nothing_allocated(running)
        response = httpx.post(running.base_url + COMPLETIONS, json={"model": TINY_MODEL, "prompt": "Hi"}, timeout=30)
        assert response.status_code == 200, response.text
        assert httpx.get(running.base_url + "/health", timeout=30).status_code == 200


# KV-cache exhaustion

KV_EXHAUSTION_BYTES = 256 << 10  # 512 tokens of the tiny Llama: a quarter of what the requests below need at once
NUM_LONG_REQUESTS = 16
LONG_MAX_TOKENS = 120


async def post_all(base_url: str, bodies: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(client.post(COMPLETIONS, json=body) for body in bodies))


def test_exhausting_the_kv_cache_preempts_yet_every_request_gets_its_unconstrained_greedy_text(tiny_checkpoints):
    prompts = [[4 + (7 * i + j) % 500 for j in range(8 + i)] for i in range(NUM_LONG_REQUESTS)]
    params = SamplingParams(max_tokens=LONG_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    unconstrained = LLM(str(tiny_checkpoints["llama"]), kv_cache_memory_bytes=64 << 20).generate(prompts, params)

    bodies = [{"model": TINY_MODEL, "prompt": prompt, "max_tokens": LONG_MAX_TOKENS, "temperature": 0,
               "ignore_eos": True} for prompt in prompts]  # fmt: skip
    with tiny_server(tiny_checkpoints, kv_cache_memory_bytes=KV_EXHAUSTION_BYTES, max_num_seqs=16) as running:
        num_tokens_needed = sum(len(prompt) + LONG_MAX_TOKENS for prompt in prompts)
        assert num_tokens_needed > 4 * running.engine.core.kv_cache.num_tokens
        responses = asyncio.run(post_all(running.base_url, bodies))

        assert [response.status_code for response in responses] == [200] * NUM_LONG_REQUESTS
        choices = [response.json()["choices"][0] for response in responses]
        assert [choice["finish_reason"] for choice in choices] == ["length"] * NUM_LONG_REQUESTS
        assert [choice["text"] for choice in choices] == [output.text for output in unconstrained]
        assert running.metric("preemptions_total") > 0
        print(f"\nKV exhaustion: {running.metric('preemptions_total'):.0f} preemptions, all {NUM_LONG_REQUESTS} equal")
        assert_nothing_allocated(running)
