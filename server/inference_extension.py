"""The metrics of the Gateway API Inference Extension's model-server protocol (kubernetes-sigs/
gateway-api-inference-extension, docs/proposals/003-model-server-protocol), under the vLLM names its endpoint picker
reads by default, so that a picker (and llm-d, KServe and the routers built on it) routes to kvserve replicas by
their queues and KV caches as it routes to vLLM's. They are views of the same step stats as kvserve's own metrics:

- `vllm:num_requests_waiting` (the protocol's TotalQueuedRequests): requests queued, not running, preempted ones
  included;
- `vllm:num_requests_running`: requests in the running batch;
- `vllm:kv_cache_usage_perc` (KVCacheUtilization), and `vllm:gpu_cache_usage_perc`, its older name, which earlier
  vLLM releases exported and older pickers read: the share of KV blocks held by requests, from 0 to 1 (a
  fraction, as vLLM reports it, despite the name); blocks kept only for the prefix cache count as free, as they are
  free to evict;
- `vllm:cache_config_info`: an info gauge (always 1) whose labels `block_size` and `num_gpu_blocks` give the
  cache's capacity in tokens (their product), as vLLM's does; `num_gpu_blocks` is the KV pool's block count on any
  device;
- `vllm:lora_requests_info` (with LoRA adapters): labels `max_lora`, `running_lora_adapters` and
  `waiting_lora_adapters` (comma-separated names), its value the time of the last step (the picker reads the series
  with the latest time). Unlike vLLM, which keeps every combination it ever had, only the current one is exported.

Each is labelled `model_name` and `engine` ("0": one engine core per server), as vLLM labels them (but
`vllm:lora_requests_info`, which vLLM labels with its three only).
"""

import time

from prometheus_client import CollectorRegistry, Gauge

from kvserve.engine.stats import StepStats
from kvserve.scheduler import LoraRequestCounts

PREFIX = "vllm:"
ENGINE_INDEX = "0"


class InferenceExtensionMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = {"model_name": model_name, "engine": ENGINE_INDEX}

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(PREFIX + name, documentation, list(labels), registry=registry).labels(**labels)

        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.")
        self.gpu_cache_usage = gauge(
            "gpu_cache_usage_perc", "KV-cache usage: 1 means 100 percent (the name before vllm:kv_cache_usage_perc)."
        )
        self._cache_config = Gauge(
            PREFIX + "cache_config_info", "The KV cache's shape: block_size tokens a block, num_gpu_blocks blocks.",
            [*labels, "block_size", "num_gpu_blocks"], registry=registry,
        )  # fmt: skip
        self._lora_info = Gauge(
            PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=registry,
        )  # fmt: skip
        self._labels = labels
        self._cache_shape: tuple[int, int] | None = None
        self._lora_labels: dict[str, str] | None = None

    def record_step(self, stats: StepStats) -> None:
        """Called on the engine thread after every loop iteration, with kvserve's own metrics."""
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_running.set(stats.num_running)
        usage = stats.kv_usage
        self.kv_cache_usage.set(usage.usage_fraction)
        self.gpu_cache_usage.set(usage.usage_fraction)
        shape = (usage.block_size, usage.num_total_blocks)
        if shape != self._cache_shape:  # known from the first step on, and fixed
            self._cache_shape = shape
            self._cache_config.clear()
            block_size, num_blocks = shape
            self._cache_config.labels(**self._labels, block_size=str(block_size), num_gpu_blocks=str(num_blocks)).set(1)
        if stats.lora_requests is not None:
            self._record_loras(stats.lora_requests)

    def _record_loras(self, counts: LoraRequestCounts) -> None:
        labels = {
            "max_lora": str(counts.max_loras), "waiting_lora_adapters": ",".join(counts.waiting),
            "running_lora_adapters": ",".join(counts.running),
        }  # fmt: skip
        if labels != self._lora_labels:
            self._lora_info.clear()
            self._lora_labels = labels
        self._lora_info.labels(**labels).set(time.time())
