"""KV cache usage over a run, read from the target's Prometheus `/metrics` about twice a second.

Only kvserve exports `kvserve:kv_cache_usage_ratio`; against another server the first scrape finds no such
sample and the scraper stops quietly: no KV plot, and no error.
"""

import asyncio
import time

import httpx

KV_USAGE_METRIC = "kvserve:kv_cache_usage_ratio"
SCRAPE_INTERVAL_S = 0.5
SCRAPE_TIMEOUT_S = 2.0


async def scrape_kv_usage(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str], run_start_s: float, stop: asyncio.Event
) -> list[tuple[float, float]]:
    """(seconds since the run began, usage ratio) samples until `stop` is set."""
    samples: list[tuple[float, float]] = []
    while True:
        ratio = await _read_kv_usage(client, base_url + "/metrics", headers)
        if ratio is None and not samples:
            return samples
        if ratio is not None:  # a later scrape that fails (the server is busy) only leaves a gap
            samples.append((time.perf_counter() - run_start_s, ratio))
        try:
            await asyncio.wait_for(stop.wait(), SCRAPE_INTERVAL_S)
            return samples
        except TimeoutError:
            pass


async def _read_kv_usage(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> float | None:
    try:
        response = await client.get(url, headers=headers, timeout=SCRAPE_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return parse_kv_usage(response.text) if response.status_code == 200 else None


def parse_kv_usage(exposition: str) -> float | None:
    """The first `kvserve:kv_cache_usage_ratio` sample in Prometheus text format; None if there is none."""
    for line in exposition.splitlines():
        rest = line.removeprefix(KV_USAGE_METRIC)
        if rest == line or rest[:1] not in ("{", " "):
            continue  # another metric, or one whose name only starts the same
        value = rest.rsplit("}", 1)[-1].split()  # after the labels: the value, maybe a timestamp
        try:
            return float(value[0])
        except (IndexError, ValueError):
            return None
    return None
