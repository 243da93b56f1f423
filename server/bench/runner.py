"""One benchmark run: send the requests on their schedule, within the concurrency cap, and scrape KV usage."""

import asyncio
import time
from dataclasses import dataclass

import httpx

from kvserve.server.bench.arrivals import arrival_times_s
from kvserve.server.bench.client import RequestRecord, send_request
from kvserve.server.bench.config import BenchConfig
from kvserve.server.bench.kv_scraper import scrape_kv_usage
from kvserve.server.bench.workload import BenchRequest


@dataclass(frozen=True)
class BenchRun:
    records: tuple[RequestRecord, ...]
    duration_s: float  # from the first send to the end of the last response
    kv_usage: tuple[tuple[float, float], ...]  # (seconds since the start, ratio); empty unless the target is kvserve


def http_client(timeout_s: float) -> httpx.AsyncClient:
    # No pool limit: with httpx's default of 100 connections, requests past the 100th would wait for a free
    # connection on the client and that wait would count as server latency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits)


async def run_benchmark(client: httpx.AsyncClient, config: BenchConfig, requests: list[BenchRequest]) -> BenchRun:
    gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    send_times_s = arrival_times_s(len(requests), config.request_rate, config.seed)
    start_s = time.perf_counter()
    stop_scraping = asyncio.Event()
    scraper = asyncio.create_task(scrape_kv_usage(client, config.base_url, config.headers, start_s, stop_scraping))

    async def one(index: int, request: BenchRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, start_s + send_times_s[index] - time.perf_counter()))
        if gate is None:
            return await send_request(client, config, index, request, start_s)
        async with gate:  # its start time is taken inside, so the wait for a slot is not latency
            return await send_request(client, config, index, request, start_s)

    records = await asyncio.gather(*(one(index, request) for index, request in enumerate(requests)))
    duration_s = time.perf_counter() - start_s
    stop_scraping.set()
    return BenchRun(records=tuple(records), duration_s=duration_s, kv_usage=tuple(await scraper))
