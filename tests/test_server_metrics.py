"""GET /metrics: every metric with its type and labels, and values that follow a known workload.

Each test gets a fresh server on the tiny Llama, so counters start at zero and can be checked exactly.
"""

import json
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import RunningServer, running_server

MODEL = "tiny-llama"
SETTLE_TIMEOUT_S = 5.0

EXPECTED_TYPES = {
    "kvserve:num_requests_running": "gauge",
    "kvserve:num_requests_waiting": "gauge",
    "kvserve:num_requests_preempted_waiting": "gauge",
    "kvserve:tensor_parallel_size": "gauge",
    "kvserve:kv_cache_blocks": "gauge",
    "kvserve:kv_cache_used_blocks": "gauge",
    "kvserve:kv_cache_usage_ratio": "gauge",
    "kvserve:kv_cache_slot_utilization_ratio": "gauge",
    "kvserve:prompt_tokens": "counter",
    "kvserve:generation_tokens": "counter",
    "kvserve:preemptions": "counter",
    "kvserve:kv_events_dropped": "counter",
    "kvserve:prefix_cache_queried_tokens": "counter",
    "kvserve:prefix_cache_hit_tokens": "counter",
    "kvserve:client_disconnects": "counter",
    "kvserve:moe_expert_tokens": "counter",
    "kvserve:moe_expert_load_imbalance": "gauge",
    "kvserve:lora_requests_running": "gauge",
    "kvserve:lora_requests_waiting": "gauge",
    "kvserve:num_requests_running_by_priority": "gauge",
    "kvserve:num_requests_waiting_by_priority": "gauge",
    "kvserve:spec_decode_num_drafts": "counter",
    "kvserve:spec_decode_num_draft_tokens": "counter",
    "kvserve:spec_decode_num_accepted_tokens": "counter",
    "kvserve:requests_finished": "counter",
    "kvserve:requests_rejected": "counter",
    "kvserve:http_requests": "counter",
    "kvserve:time_to_first_token_seconds": "histogram",
    "kvserve:inter_token_latency_seconds": "histogram",
    "kvserve:e2e_request_latency_seconds": "histogram",
    "kvserve:request_queue_time_seconds": "histogram",
    "kvserve:request_prefill_time_seconds": "histogram",
    "kvserve:request_decode_time_seconds": "histogram",
    "kvserve:request_prompt_tokens": "histogram",
    "kvserve:request_generation_tokens": "histogram",
    "kvserve:step_batch_requests": "histogram",
    "kvserve:step_batch_tokens": "histogram",
}
EXTRA_LABELS = {  # beyond model_name (and a histogram bucket's `le`)
    "kvserve:requests_finished": {"finished_reason"},
    "kvserve:requests_rejected": {"reason"},
    "kvserve:http_requests": {"route", "method", "status"},
    "kvserve:moe_expert_tokens": {"expert"},
    "kvserve:lora_requests_running": {"lora_name"},
    "kvserve:lora_requests_waiting": {"lora_name"},
    "kvserve:num_requests_running_by_priority": {"priority"},
    "kvserve:num_requests_waiting_by_priority": {"priority"},
}


@pytest.fixture
def fresh(tiny_checkpoints):
    with running_server(
        model=str(tiny_checkpoints["llama"]), served_model_name=MODEL, kv_cache_memory_bytes=4 << 20
    ) as running:
        yield running


@pytest.fixture
def client(fresh) -> openai.OpenAI:
    with openai.OpenAI(base_url=fresh.base_url + "/v1", api_key="unused", max_retries=0) as sdk_client:
        yield sdk_client


def scrape(running: RunningServer) -> dict:
    response = httpx.get(running.base_url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, "the metrics did not settle in time"
        time.sleep(0.01)


def greedy(max_tokens: int, **extra_body) -> dict:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": max_tokens,
        "extra_body": {"ignore_eos": True, **extra_body},
    }


def streamed_usage(stream) -> openai.types.CompletionUsage:
    chunks = list(stream)
    assert chunks[-1].choices == []
    return chunks[-1].usage


def test_every_metric_is_exposed_with_its_type_and_labels(fresh):
    families = scrape(fresh)

    kvserve = {name: family for name, family in families.items() if name.startswith("kvserve:")}
    assert {name: family.type for name, family in kvserve.items()} == EXPECTED_TYPES
    for name, family in kvserve.items():
        assert family.documentation, name
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL
            labels = set(sample.labels) - {"model_name", "le"}
            assert labels == EXTRA_LABELS.get(name, set()), sample
    reasons = {s.labels["finished_reason"] for s in kvserve["kvserve:requests_finished"].samples}
    assert reasons == {"stop", "length", "abort", "error"}
    assert {s.labels["reason"] for s in kvserve["kvserve:requests_rejected"].samples} == {"overload", "validation"}
    assert fresh.metric("kv_cache_blocks") == fresh.engine.core.kv_cache.num_blocks > 0
    assert "process_resident_memory_bytes" in families


def test_counters_and_histograms_follow_a_known_workload(fresh, client):
    usages = [
        streamed_usage(client.completions.create(prompt="The cache is", stream=True,
                                                 stream_options={"include_usage": True}, **greedy(7))),
        streamed_usage(client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], stream=True,
                                                      stream_options={"include_usage": True}, **greedy(5))),
        client.completions.create(prompt="A block table", **greedy(3)).usage,
    ]  # fmt: skip
    # Every token is a stop token: finished by "stop" after exactly one token.
    every_token = list(range(fresh.engine.core.vocab_size))
    stopped = client.completions.create(prompt="Stop at once", **greedy(9, stop_token_ids=every_token))
    assert stopped.choices[0].finish_reason == "stop"
    usages.append(stopped.usage)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt="Too long", **greedy(10**6))
    bad_json = httpx.post(
        fresh.base_url + "/v1/completions", content=b"{", headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400

    num_requests = len(usages)
    prompt_tokens = sum(usage.prompt_tokens for usage in usages)
    generation_tokens = sum(usage.completion_tokens for usage in usages)
    assert generation_tokens == 7 + 5 + 3 + 1
    # Counted before the tokens are published: a client that has its answer finds it counted.
    assert fresh.metric("generation_tokens_total") == generation_tokens
    assert fresh.metric("prompt_tokens_total") == prompt_tokens
    assert fresh.metric("time_to_first_token_seconds_count") == num_requests
    assert fresh.metric("inter_token_latency_seconds_count") == generation_tokens - num_requests
    finished = {reason: fresh.metric("requests_finished_total", finished_reason=reason)
                for reason in ("stop", "length", "abort", "error")}  # fmt: skip
    assert finished == {"stop": 1, "length": 3, "abort": 0, "error": 0}
    assert fresh.metric("requests_rejected_total", reason="validation") == 2
    assert fresh.metric("requests_rejected_total", reason="overload") == 0

    # Request histograms: one observation per completed request; the phases add up to the whole.
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens"):  # fmt: skip
        assert fresh.metric(name + "_count") == num_requests, name
    phases = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds")
    assert sum(fresh.metric(name + "_sum") for name in phases) == pytest.approx(
        fresh.metric("e2e_request_latency_seconds_sum")
    )
    assert fresh.metric("e2e_request_latency_seconds_sum") >= fresh.metric("time_to_first_token_seconds_sum") > 0
    assert fresh.metric("request_prompt_tokens_sum") == prompt_tokens
    assert fresh.metric("request_generation_tokens_sum") == generation_tokens
    assert fresh.metric("request_generation_tokens_bucket", le="1.0") == 1  # the stopped request

    # Every prompt token not found in the prefix cache, and every sampled token but each request's last, was
    # computed in some step (nothing was preempted and recomputed).
    assert fresh.metric("preemptions_total") == 0
    computed = prompt_tokens - fresh.metric("prefix_cache_hit_tokens_total") + generation_tokens - num_requests
    assert fresh.metric("step_batch_tokens_sum") == computed
    assert fresh.metric("prefix_cache_queried_tokens_total") == prompt_tokens
    assert fresh.metric("step_batch_requests_count") == fresh.metric("step_batch_tokens_count") > 0

    fresh.wait_until_idle()
    assert (fresh.metric("num_requests_running"), fresh.metric("num_requests_waiting")) == (0, 0)
    assert (fresh.metric("kv_cache_used_blocks"), fresh.metric("kv_cache_usage_ratio")) == (0, 0)

    def http(route: str, status: int) -> float | None:
        return fresh.metric("http_requests_total", route=route, method="POST", status=str(status))

    wait_for(lambda: http("/v1/completions", 400) == 2)  # counted once the response is sent
    assert (http("/v1/completions", 200), http("/v1/chat/completions", 200)) == (3, 1)


def test_gauges_show_a_running_request_and_an_abort_is_counted_when_its_client_leaves(fresh):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=fresh.base_url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        for _ in range(2):
            assert json.loads(next(events).removeprefix("data: "))["choices"][0]["finish_reason"] is None
        assert fresh.metric("num_requests_running") == 1
        assert fresh.metric("kv_cache_used_blocks") > 0
        assert 0 < fresh.metric("kv_cache_usage_ratio") < 1
        assert 0 < fresh.metric("kv_cache_slot_utilization_ratio") <= 1

    wait_for(lambda: fresh.metric("requests_finished_total", finished_reason="abort") == 1)
    wait_for(lambda: fresh.metric("num_requests_running") == 0)
    assert fresh.metric("client_disconnects_total") == 1
    assert fresh.metric("kv_cache_used_blocks") == 0
    assert fresh.metric("e2e_request_latency_seconds_count") == 0  # only completed requests are timed
    assert fresh.metric("time_to_first_token_seconds_count") == 1


def test_unknown_paths_and_methods_are_counted_under_one_label_each(fresh):
    for path in ("/nope", "/v2/anything", "/v1/completions/extra"):
        assert httpx.get(fresh.base_url + path).status_code == 404
    assert httpx.get(fresh.base_url + "/health").status_code == 200
    assert httpx.request("BREW", fresh.base_url + "/health").status_code == 405

    wait_for(lambda: fresh.metric("http_requests_total", route="other", method="GET", status="404") == 3)
    assert fresh.metric("http_requests_total", route="/health", method="GET", status="200") == 1
    wait_for(lambda: fresh.metric("http_requests_total", route="/health", method="other", status="405") == 1)
