"""Engine settings in one frozen dataclass; derived values are resolved once the model is known."""

from dataclasses import dataclass
from typing import Literal

import torch

from kvserve.engine.speculative.config import SpeculativeConfig
from kvserve.kernels import check_backend_name
from kvserve.scheduler import SCHEDULING_POLICIES, SchedulingPolicy

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine runs and with which limits.

    model: a HF checkpoint directory; None means the built-in default model (a toy trained on the KJV).
    dtype: "auto" (float32 on CPU, the checkpoint's 16-bit dtype on CUDA), "float32", "bfloat16", "float16".
    kv_cache_dtype: "auto" (K and V in the model's dtype) or "int8" (one fp32 scale per token and head;
        about half the bytes of a 16-bit cache).
    kv_cache_memory_bytes: byte budget of the KV cache (each rank's, with tensor parallelism); None means 1 GiB
        on CPU and `gpu_memory_utilization` of the GPU's memory, less what the model and a warm-up step use, on CUDA.
    max_model_len: context window; None means the model's.
    max_num_batched_tokens: per-step token budget; None means 2048, or max(2048, max_model_len) without
        chunked prefill (then a whole prompt must fit in one step).
    enable_chunked_prefill: compute long prompts over several steps, beside the decodes.
    max_prefill_chunk_tokens: cap on one request's prefill chunk per step; None means the budget.
    enable_prefix_caching: reuse the KV blocks of a cached prompt prefix instead of computing them again.
    task: "generate" (tokens), "embed" (one pooled vector per prompt, engine/pooling.py), or "auto": embed exactly
        when the model directory is a sentence-transformers one (it has modules.json).
    pooling, normalize: an embedding model's pooling (last token, mean, first token) and whether its vector is
        L2-normalised; None: as its sentence-transformers configuration says, else last token, normalised.
    attention_backend: "auto" (the Triton kernels on CUDA, the C++ kernels on a CPU, the torch path where
        they cannot be built), "triton", "cpu" or "torch".
    enforce_eager: run every step eagerly; by default, on CUDA, pure-decode steps replay CUDA graphs (on every
        rank, with tensor parallelism too).
    eager_graph_replay: for tests: capture the decode ladder on any device and replay it by running the forward
        again on the same buffers (`EagerReplay`), so the padded-batch path of CUDA graphs runs where there is no GPU.
    tensor_parallel_size: ranks the model is split over (heads, MLP and vocabulary; each rank its own KV heads);
        kvserve starts the other ranks itself, or joins them under torchrun-style variables (README).
    tensor_parallel_timeout_s: how long a step's collective may wait for a rank before the engine gives up on it
        (meeting and loading at start-up may take ten minutes; idle time between steps is not bounded).
    prefix_cache_hash_seed: seed of the prefix cache's block hashes (vLLM's NONE_HASH seed); None means
        $PYTHONHASHSEED if set, else vLLM's default, so replicas and routers agree on every block's hash.
    kv_events_endpoint: publish KV-cache events (vLLM's format) on this ZMQ endpoint, e.g. "tcp://*:5557"
        (bound) or "tcp://router:5557" (connected to); None (the default) publishes nothing.
    kv_events_replay_endpoint: a ZMQ ROUTER endpoint (bound) replaying recent batches to a subscriber that missed
        some; kv_events_replay_batches: how many are kept.
    kv_events_topic: the topic every batch is sent under (llm-d reads "kv@<pod>@<model>").
    kv_events_queue_size: batches (one per step that changed the cache) waiting to be sent; past it a step drops
        its batch and counts the events in kvserve:kv_events_dropped_total.
    kv_events_format: "map" (tagged maps, vLLM's current encoding) or "array" (positional, vLLM's older one).
    kv_events_int_hashes: block hashes as their low 64 bits (vLLM's default) instead of all 32 bytes.
    enable_lora: serve LoRA adapters (PEFT's format) over the base model, many in one batch.
    max_loras: adapters resident at once (their weights in the model's slots); a step runs requests of at most
        this many adapters, and others wait. Every adapter loaded is kept on the host and copied into a slot when a
        step needs it, replacing the least recently used one.
    max_lora_rank: the largest rank an adapter may have (the slots are this wide).
    lora_modules: (name, path) of adapters loaded at start.
    scheduling_policy: "fcfs" (arrival order; a request's `priority` must be 0) or "priority" (vLLM's: the waiting
        queue ordered by (priority, arrival), lower values first; the lowest-priority running request is preempted
        when memory runs short, and a waiting request that does not fit preempts running ones of lower priority).
    speculative_config: speculative decoding (engine/speculative/config.py: vLLM's keys, methods "ngram", "suffix"
        and "draft_model"; a dict of them is taken too); None: off.
    """

    model: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    max_prefill_chunk_tokens: int | None = None
    enable_prefix_caching: bool = True
    task: Literal["auto", "generate", "embed"] = "auto"
    pooling: Literal["last", "mean", "cls"] | None = None
    normalize: bool | None = None
    max_model_len: int | None = None
    watermark_fraction: float = 0.01
    attention_backend: str = "auto"
    enforce_eager: bool = False
    eager_graph_replay: bool = False
    seed: int = 0
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 60.0
    prefix_cache_hash_seed: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_replay_batches: int = 10_000
    kv_events_topic: str = ""
    kv_events_queue_size: int = 1000
    kv_events_format: Literal["map", "array"] = "map"
    kv_events_int_hashes: bool = True
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    scheduling_policy: SchedulingPolicy = "fcfs"
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 <= self.watermark_fraction < 1:
            raise ValueError(f"watermark_fraction must be in [0, 1), got {self.watermark_fraction}")
        check_backend_name(self.attention_backend)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_timeout_s <= 0:
            raise ValueError(f"tensor_parallel_timeout_s must be positive, got {self.tensor_parallel_timeout_s}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            policies = ", ".join(SCHEDULING_POLICIES)
            raise ValueError(f"scheduling_policy must be one of {policies}, got {self.scheduling_policy!r}")
        self._check_kv_events()
        self._check_lora()
        if isinstance(self.speculative_config, dict):  # vLLM's form: LLM(model, speculative_config={...})
            object.__setattr__(self, "speculative_config", SpeculativeConfig(**self.speculative_config))

    def _check_kv_events(self) -> None:
        if self.kv_events_endpoint is None and self.kv_events_replay_endpoint is not None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint (the events it replays)")
        if self.kv_events_queue_size < 1 or self.kv_events_replay_batches < 1:
            raise ValueError("kv_events_queue_size and kv_events_replay_batches must be at least 1")
        if self.kv_events_format not in ("map", "array"):
            raise ValueError(f"kv_events_format must be map or array, got {self.kv_events_format!r}")
        if self.kv_events_endpoint is not None and not self.enable_prefix_caching:
            raise ValueError("kv_events_endpoint needs enable_prefix_caching: without it no block is ever cached")

    def _check_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora with tensor_parallel_size > 1 is not supported yet")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if self.dtype != "auto":
            dtype = getattr(torch, self.dtype, None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
            return dtype
        if device.type == "cpu":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16

    def torch_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.int8 if self.kv_cache_dtype == "int8" else model_dtype
