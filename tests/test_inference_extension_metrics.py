"""The Inference Extension's model-server metrics (server/inference_extension.py), scraped over HTTP as its endpoint
picker scrapes them: vLLM's names, types and labels, and values equal to the engine's own queues, KV usage and
cache shape."""

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.server_harness import running_server
from tests.test_server_metrics import scrape

MODEL = "tiny-llama"
LABELS = {"model_name": MODEL, "engine": "0"}
GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc", "vllm:cache_config_info")  # fmt: skip
SETTLE_TIMEOUT_S = 10.0


@pytest.fixture
def one_at_a_time(tiny_checkpoints):
    """A server that runs one request at a time, so a second one waits."""
    with running_server(
        model=str(tiny_checkpoints["llama"]), served_model_name=MODEL, kv_cache_memory_bytes=4 << 20, max_num_seqs=1
    ) as running:
        yield running


def values(running) -> dict[str, float]:
    """Each picker gauge's one sample (cache_config_info's labels as the value), and kvserve's own KV usage."""
    families = scrape(running)
    found = {}
    for name in GAUGES:
        (sample,) = families[name].samples
        assert {k: v for k, v in sample.labels.items() if k in LABELS} == LABELS, sample
        found[name] = sample.value if name != "vllm:cache_config_info" else sample
    (own,) = families["kvserve:kv_cache_usage_ratio"].samples
    found["kvserve:kv_cache_usage_ratio"] = own.value
    return found


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, "the engine did not reach the state in time"
        time.sleep(0.01)


def test_the_pickers_gauges_carry_vllms_labels_and_the_caches_shape(one_at_a_time):
    families = scrape(one_at_a_time)
    for name in GAUGES:
        assert families[name].type == "gauge", name
        assert families[name].documentation, name
    found = values(one_at_a_time)
    info = found["vllm:cache_config_info"]
    assert info.value == 1
    kv_cache = one_at_a_time.engine.core.kv_cache
    assert set(info.labels) == {*LABELS, "block_size", "num_gpu_blocks"}
    assert int(info.labels["num_gpu_blocks"]) == kv_cache.num_blocks > 0
    assert int(info.labels["block_size"]) == one_at_a_time.engine.kv_usage().block_size == 16
    idle = [found[name] for name in GAUGES[:4]]
    assert idle == [0, 0, 0, 0]


def test_queues_and_kv_usage_are_the_engines(one_at_a_time):
    """One request decoding, one waiting behind it: the picker reads both queues and the running one's blocks."""
    scheduler = one_at_a_time.engine.core.scheduler
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    waiting_answer = []
    with (
        httpx.Client(base_url=one_at_a_time.base_url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json={**body, "stream": True}) as first,
    ):
        events = (line for line in first.iter_lines() if line.startswith("data: "))
        assert json.loads(next(events).removeprefix("data: "))["choices"][0]["finish_reason"] is None
        second = {**body, "prompt": "A second story", "max_tokens": 5}
        url = one_at_a_time.base_url + "/v1/completions"
        waiter = threading.Thread(target=lambda: waiting_answer.append(httpx.post(url, json=second, timeout=30)))
        waiter.start()
        wait_for(lambda: len(scheduler.waiting) == 1)
        wait_for(lambda: values(one_at_a_time)["vllm:num_requests_waiting"] == 1)
        found = values(one_at_a_time)
        assert found["vllm:num_requests_running"] == len(scheduler.running) == 1
        # The gauges are set after each step; the running request may have taken a block since.
        usage = one_at_a_time.engine.kv_usage()
        assert found["vllm:kv_cache_usage_perc"] == found["vllm:gpu_cache_usage_perc"]
        assert found["vllm:kv_cache_usage_perc"] == found["kvserve:kv_cache_usage_ratio"] > 0
        assert abs(found["vllm:kv_cache_usage_perc"] - usage.usage_fraction) <= 1 / usage.num_total_blocks
    waiter.join(timeout=SETTLE_TIMEOUT_S)
    assert waiting_answer[0].status_code == 200  # it ran once the first client left
    one_at_a_time.wait_until_idle()
    wait_for(lambda: values(one_at_a_time)["vllm:kv_cache_usage_perc"] == 0)
    found = values(one_at_a_time)
    assert [found["vllm:num_requests_waiting"], found["vllm:num_requests_running"]] == [0, 0]
