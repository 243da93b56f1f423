"""A real Prometheus (Debian's `prometheus` package) scrapes a live kvserve on loopback; promtool lints the scrape.

The Grafana dashboard's queries run against that Prometheus too, so they name metrics and labels that exist.
"""

import json
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.server_harness import RunningServer, running_server
from tests.tools import require_tool

MODEL = "tiny-llama"
DASHBOARD = Path(__file__).parent.parent / "docker" / "grafana" / "dashboards" / "kvserve.json"
INSTALL_HINT = "apt-get install prometheus"
WAIT_S = 30.0  # for Prometheus to start, find the target up and ingest a scrape (it scrapes every second)


@pytest.fixture(scope="module")
def server(tiny_checkpoints) -> Iterator[RunningServer]:
    with running_server(
        model=str(tiny_checkpoints["llama"]), served_model_name=MODEL, kv_cache_memory_bytes=4 << 20
    ) as running:
        yield running


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition: Callable[[], bool], what: str, log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {WAIT_S} s; Prometheus' log:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


@contextmanager
def prometheus_scraping(target: str, workdir: Path) -> Iterator[tuple[str, Path]]:
    """Prometheus on a free loopback port, scraping `target` (host:port) every second; yields its URL and log."""
    binary = require_tool("prometheus", INSTALL_HINT)
    config = workdir / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        f"scrape_configs:\n  - job_name: kvserve\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    address = f"127.0.0.1:{free_port()}"
    log = workdir / "prometheus.log"
    with log.open("w") as log_file:
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={address}", "--log.level=warn"],
            stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield f"http://{address}", log
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def query(prometheus_url: str, promql: str) -> list[dict] | None:
    """The query's result vector; None while Prometheus is not answering yet."""
    try:
        response = httpx.get(prometheus_url + "/api/v1/query", params={"query": promql}, timeout=5)
    except httpx.TransportError:
        return None
    assert response.status_code == 200, f"{promql}: {response.text}"
    return response.json()["data"]["result"]


def query_value(prometheus_url: str, promql: str) -> float | None:
    result = query(prometheus_url, promql)
    return float(result[0]["value"][1]) if result else None


def dashboard_queries() -> list[str]:
    """Every panel's PromQL, with Grafana's variables filled in as Grafana would for this server."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel["targets"]]
    return [expr.replace("$model", MODEL).replace("$__rate_interval", "1m") for expr in exprs]


def target_health(prometheus_url: str) -> str | None:
    try:
        response = httpx.get(prometheus_url + "/api/v1/targets", timeout=5)
    except httpx.TransportError:
        return None
    targets = response.json()["data"]["activeTargets"] if response.status_code == 200 else []
    return targets[0]["health"] if targets else None


def test_prometheus_scrapes_the_server_and_reads_the_generation_token_count(server, tmp_path):
    target = server.base_url.removeprefix("http://")
    with prometheus_scraping(target, tmp_path) as (prometheus_url, log):
        num_tokens = 0
        for max_tokens in (4, 6):
            body = {"model": MODEL, "prompt": "Scraped", "max_tokens": max_tokens, "ignore_eos": True}
            response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
            num_tokens += response.json()["usage"]["completion_tokens"]
        assert num_tokens == 10
        too_long = {"model": MODEL, "prompt": "Refused", "max_tokens": 10**6}  # gives the error panel a series
        assert httpx.post(server.base_url + "/v1/completions", json=too_long, timeout=30).status_code == 400

        wait_until(lambda: target_health(prometheus_url) == "up", "the kvserve target was not up", log)
        tokens = f'kvserve:generation_tokens_total{{model_name="{MODEL}",job="kvserve"}}'
        wait_until(lambda: query_value(prometheus_url, tokens) == num_tokens, f"{tokens} != {num_tokens}", log)
        assert query_value(prometheus_url, f'kvserve:time_to_first_token_seconds_count{{model_name="{MODEL}"}}') == 2

        # rate() needs two samples of a series in its window.
        samples = f"count_over_time({tokens}[1m])"
        wait_until(lambda: (query_value(prometheus_url, samples) or 0) >= 2, "fewer than two scrapes stored", log)
        for promql in dashboard_queries():
            assert query(prometheus_url, promql), f"the dashboard's {promql!r} finds no series"


def test_promtool_finds_nothing_but_the_prefix_colon_in_the_scrape(server):
    """`promtool check metrics` lints HELP, TYPE, units and counter names. Its one complaint is the `kvserve:` prefix
    (and the `vllm:` one of the Inference Extension's names): colons are left for recording rules by convention, and
    the prefix follows vLLM's `vllm:` on purpose."""
    promtool = require_tool("promtool", INSTALL_HINT)
    httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Lint me", "max_tokens": 2})
    scrape = httpx.get(server.base_url + "/metrics").text

    result = subprocess.run([promtool, "check", "metrics"], input=scrape, capture_output=True, text=True, timeout=30)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    # promtool lints the families that have samples (a dense model has no expert-load samples);
    # a histogram's samples are its name with _bucket, _sum and _count.
    # The Inference Extension's `vllm:` names (server/inference_extension.py) draw the same complaint.
    prefixes = ("kvserve:", "vllm:")
    sampled = {line.split("{")[0].split()[0] for line in scrape.splitlines() if line.startswith(prefixes)}
    types = tuple(f"# TYPE {prefix}" for prefix in prefixes)
    declared = {line.split()[2] for line in scrape.splitlines() if line.startswith(types)}
    families = {name for name in declared if any(sample.startswith(name) for sample in sampled)}
    assert len(families) > 20
    assert sorted(problems) == sorted(f"{name} metric names should not contain ':'" for name in families)
