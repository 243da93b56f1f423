"""Scheduler limits."""

from dataclasses import dataclass

from kvserve.kvcache.block_hash import DEFAULT_HASH_SEED
from kvserve.scheduler.request_queue import SCHEDULING_POLICIES, SchedulingPolicy


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of the scheduler.

    `watermark_blocks` is kept free at admission so running requests can still grow a little
    before anything must be preempted. With `enable_chunked_prefill`, a prompt longer than what is
    left of the step's token budget (or than `max_prefill_chunk_tokens`) is computed over several
    steps, alongside the decodes; without it, a prompt waits until it fits whole. With
    `enable_prefix_caching`, an admitted request reuses the cached blocks of its longest cached
    prefix and computes only the rest. `block_hash_seed` seeds the chain of block hashes (vLLM's
    `NONE_HASH` seed): replicas with the same seed give the same prefix the same hashes. `max_loras`: the most
    LoRA adapters the running requests may use at once (None: no limit); a waiting request of another adapter
    waits, and later requests that fit are admitted past it. `policy`: "fcfs" admits in arrival order and preempts
    the most recently admitted request; "priority" admits by (priority, arrival), preempts the lowest-priority
    request (the largest value, the latest arrival among equals), and lets a waiting request that does not fit
    preempt running ones of lower priority (scheduler/scheduler.py).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    watermark_blocks: int = 0
    enable_chunked_prefill: bool = False
    max_prefill_chunk_tokens: int | None = None
    enable_prefix_caching: bool = False
    block_hash_seed: str = DEFAULT_HASH_SEED
    max_loras: int | None = None
    policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {self.watermark_blocks}")
        if self.max_prefill_chunk_tokens is not None and self.max_prefill_chunk_tokens < 1:
            raise ValueError(f"max_prefill_chunk_tokens must be >= 1, got {self.max_prefill_chunk_tokens}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
