"""Prometheus metrics: the engine's step stats, the server's rejections and disconnects, HTTP counts.

Every metric is named `kvserve:<what>_<unit>` and labelled with the served model's name; beside them, the few
the Inference Extension's endpoint picker reads, under vLLM's names (server/inference_extension.py). Each app
has its own `CollectorRegistry`, so a process (or a test session) can hold many apps. The engine
thread calls `record_step` once per loop iteration; it only sets gauges and adds to counters and
histograms (bulk ones: see server/bulk_histogram.py).
"""

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.engine.stats import FINISH_REASONS, StepStats
from kvserve.scheduler import LoraRequestCounts, PriorityRequestCounts
from kvserve.server.bulk_histogram import BulkHistogram, BulkHistogramCollector
from kvserve.server.inference_extension import InferenceExtensionMetrics

PREFIX = "kvserve:"
REJECT_REASONS = ("overload", "validation")
# Label values a client controls stay bounded: other methods count as "other", as unknown paths do.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# No `<counter>_created` series: a second series per counter and histogram that no dashboard reads.
disable_created_metrics()


def _one_two_five(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: token counts span several orders of magnitude."""
    buckets, scale = [], 1
    while scale <= limit:
        buckets += [m * scale for m in (1, 2, 5) if m * scale <= limit]
        scale *= 10
    return buckets


LATENCY_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0]  # fmt: skip
REQUEST_TIME_BUCKETS_S = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                          50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0]  # fmt: skip
TOKEN_COUNT_BUCKETS = _one_two_five(200_000)
BATCH_REQUEST_BUCKETS = [2**i for i in range(11)]  # 1 .. 1024 requests
BATCH_TOKEN_BUCKETS = [2**i for i in range(16)]  # 1 .. 32768 tokens


class ServerMetrics:
    """All of kvserve's metrics for one served model, in the app's own registry."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_* memory, CPU and file descriptors
        model = model_name

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(PREFIX + name, documentation, ["model_name"], registry=self.registry).labels(model)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(PREFIX + name, documentation, ["model_name"], registry=self.registry).labels(model)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_preempted_waiting = gauge(
            "num_requests_preempted_waiting", "Waiting requests that were preempted and wait to be recomputed."
        )
        self.tensor_parallel_size = gauge(
            "tensor_parallel_size", "Ranks the model is split over (each holds its share of the KV heads)."
        )
        self.kv_cache_blocks = gauge("kv_cache_blocks", "KV cache blocks in all.")
        self.kv_cache_used_blocks = gauge("kv_cache_used_blocks", "KV cache blocks held by requests.")
        self.kv_cache_usage_ratio = gauge("kv_cache_usage_ratio", "Share of the KV cache blocks in use (0 to 1).")
        self.kv_cache_slot_utilization_ratio = gauge(
            "kv_cache_slot_utilization_ratio",
            "Share of the slots of used blocks that hold a live token; above 1 when prefix caching shares blocks.",
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests whose prefill finished.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("preemptions", "Requests preempted to free KV blocks (recomputed later).")
        self.kv_events_dropped = counter(
            "kv_events_dropped", "KV-cache events not published because the publisher's queue was full."
        )
        self.prefix_cache_queried_tokens = counter(
            "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache at admission."
        )
        self.prefix_cache_hit_tokens = counter("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.")
        self.client_disconnects = counter("client_disconnects", "Clients that went away before their answer was done.")
        self.moe_expert_tokens = Counter(
            PREFIX + "moe_expert_tokens", "Tokens routed to each expert, summed over the MoE layers (MoE models).",
            ["model_name", "expert"], registry=self.registry,
        )  # fmt: skip
        self.moe_expert_load_imbalance = gauge(
            "moe_expert_load_imbalance",
            "Tokens of the busiest expert over the mean per expert, in the last second with traffic (1 = even).",
        )
        finished = Counter(PREFIX + "requests_finished", "Requests finished, by reason.",
                           ["model_name", "finished_reason"], registry=self.registry)  # fmt: skip
        self.requests_finished = {reason: finished.labels(model, reason) for reason in FINISH_REASONS}
        rejected = Counter(PREFIX + "requests_rejected", "Requests refused before reaching the engine, by reason.",
                           ["model_name", "reason"], registry=self.registry)  # fmt: skip
        self.requests_rejected = {reason: rejected.labels(model, reason) for reason in REJECT_REASONS}
        self._http_requests = Counter(PREFIX + "http_requests", "HTTP requests answered, by route, method and status.",
                                      ["model_name", "route", "method", "status"], registry=self.registry)  # fmt: skip
        self._model_name = model

        def histogram(name: str, documentation: str, buckets: list[float]) -> BulkHistogram:
            histograms.append(BulkHistogram(PREFIX + name, documentation, buckets))
            return histograms[-1]

        histograms: list[BulkHistogram] = []
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "From arrival to the first generated token.", LATENCY_BUCKETS_S
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Between two consecutive tokens of a request.", LATENCY_BUCKETS_S
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "From arrival to the last token, for completed requests.",
            REQUEST_TIME_BUCKETS_S,
        )  # fmt: skip
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "From arrival to first scheduled, for completed requests.",
            REQUEST_TIME_BUCKETS_S,
        )  # fmt: skip
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "From first scheduled to the first token, for completed requests.",
            REQUEST_TIME_BUCKETS_S,
        )  # fmt: skip
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "From the first to the last token, for completed requests.",
            REQUEST_TIME_BUCKETS_S,
        )  # fmt: skip
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of completed requests.", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated by completed requests.", TOKEN_COUNT_BUCKETS
        )
        self.step_batch_requests = histogram(
            "step_batch_requests", "Requests in one model step.", BATCH_REQUEST_BUCKETS
        )
        self.step_batch_tokens = histogram("step_batch_tokens", "Tokens in one model step.", BATCH_TOKEN_BUCKETS)
        self.registry.register(BulkHistogramCollector(histograms, {"model_name": model}))
        self.inference_extension = InferenceExtensionMetrics(self.registry, model)
        self._lora_running = Gauge(PREFIX + "lora_requests_running", "Running requests of each LoRA adapter.",
                                   ["model_name", "lora_name"], registry=self.registry)  # fmt: skip
        self._lora_waiting = Gauge(PREFIX + "lora_requests_waiting", "Waiting requests of each LoRA adapter.",
                                   ["model_name", "lora_name"], registry=self.registry)  # fmt: skip
        self._spec_decode = [
            Counter(PREFIX + name, documentation, ["model_name"], registry=self.registry).labels(model)
            for name, documentation in (
                ("spec_decode_num_drafts", "Speculative decoding: requests that verified draft tokens, once a step."),
                ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."),
                ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."),
            )
        ]
        self._priority_running = Gauge(
            PREFIX + "num_requests_running_by_priority", "Running requests of each priority (priority policy).",
            ["model_name", "priority"], registry=self.registry,
        )  # fmt: skip
        self._priority_waiting = Gauge(
            PREFIX + "num_requests_waiting_by_priority", "Waiting requests of each priority (priority policy).",
            ["model_name", "priority"], registry=self.registry,
        )  # fmt: skip

    def record_step(self, stats: StepStats) -> None:
        """Called on the engine thread after every loop iteration."""
        self.inference_extension.record_step(stats)
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_preempted_waiting.set(stats.num_preempted_waiting)
        usage = stats.kv_usage
        self.kv_cache_blocks.set(usage.num_total_blocks)
        self.kv_cache_used_blocks.set(usage.num_used_blocks)
        self.kv_cache_usage_ratio.set(usage.usage_fraction)
        self.kv_cache_slot_utilization_ratio.set(usage.slot_utilization)
        if stats.num_batched_requests:
            self.step_batch_requests.observe_all((stats.num_batched_requests,))
            self.step_batch_tokens.observe_all((stats.num_batched_tokens,))
        # Counters only move when something happened: most steps are plain decodes.
        for counter, amount in (
            (self.prompt_tokens, stats.num_prompt_tokens),
            (self.generation_tokens, stats.num_generation_tokens),
            (self.preemptions, stats.num_preemptions),
            (self.prefix_cache_queried_tokens, stats.prefix_cache_queried_tokens),
            (self.prefix_cache_hit_tokens, stats.prefix_cache_hit_tokens),
            (self.kv_events_dropped, stats.num_dropped_kv_events),
        ):
            if amount:
                counter.inc(amount)
        if any(stats.expert_tokens):
            self._record_expert_tokens(stats.expert_tokens)
        if stats.lora_requests is not None:
            self._record_lora_requests(stats.lora_requests)
        if stats.priority_requests is not None:
            self._record_priority_requests(stats.priority_requests)
        if stats.spec_decode is not None:
            spec = stats.spec_decode
            for counter, amount in zip(
                self._spec_decode, (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens), strict=True
            ):
                counter.inc(amount)
        self.time_to_first_token.observe_all(stats.time_to_first_token_s)
        self.inter_token_latency.observe_all(stats.inter_token_latency_s)
        for reason in stats.finish_reasons:
            self.requests_finished[reason].inc()
        if stats.completed:
            completed = stats.completed
            self.e2e_request_latency.observe_all(request.e2e_latency_s for request in completed)
            self.request_queue_time.observe_all(request.queue_time_s for request in completed)
            self.request_prefill_time.observe_all(request.prefill_time_s for request in completed)
            self.request_decode_time.observe_all(request.decode_time_s for request in completed)
            self.request_prompt_tokens.observe_all(request.num_prompt_tokens for request in completed)
            self.request_generation_tokens.observe_all(request.num_generation_tokens for request in completed)

    def _record_lora_requests(self, counts: LoraRequestCounts) -> None:
        """Per adapter with requests now; an adapter without any drops out (unloaded ones would pile up)."""
        for gauge, per_adapter in ((self._lora_running, counts.running), (self._lora_waiting, counts.waiting)):
            gauge.clear()
            for name, count in per_adapter.items():
                gauge.labels(self._model_name, name).set(count)

    def _record_priority_requests(self, counts: PriorityRequestCounts) -> None:
        """Per priority with requests now: the label set stays as small as the priorities in use."""
        for gauge, per_priority in ((self._priority_running, counts.running), (self._priority_waiting, counts.waiting)):
            gauge.clear()
            for priority, count in per_priority.items():
                gauge.labels(self._model_name, str(priority)).set(count)

    def _record_expert_tokens(self, expert_tokens: list[int]) -> None:
        for expert, tokens in enumerate(expert_tokens):
            if tokens:
                self.moe_expert_tokens.labels(self._model_name, str(expert)).inc(tokens)
        self.moe_expert_load_imbalance.set(max(expert_tokens) * len(expert_tokens) / sum(expert_tokens))

    def count_http_request(self, route: str, method: str, status: int) -> None:
        self._http_requests.labels(self._model_name, route, method, str(status)).inc()

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


class CountHTTPRequests:
    """Counts every answered HTTP request by route template (not the raw path, which is unbounded), method
    and status. Outermost, so refusals by other middleware (413, 503 while draining) count too."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: list[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = self._route_template(scope)
        status = 500  # what Starlette answers if the app raises before it responds

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
            self.metrics.count_http_request(route, method, status)

    def _route_template(self, scope: Scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return getattr(route, "path", "other")
        return "other"
