"""The KV cache's size: a configured byte budget, or what the GPU has left after a warm-up; and the step limits."""

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from kvserve.engine.models import DecoderConfig, DecoderForCausalLM
from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.engine.step_inputs import InputBuffers, StepInputs
from kvserve.engine.step_plan import StepPlan
from kvserve.kernels import KernelBackend, PagedKV
from kvserve.kvcache import KVCache, KVCacheSpec

logger = logging.getLogger(__name__)


def paged_kv_layers(kv_cache: KVCache) -> list[PagedKV]:
    """Each layer's view of the cache, as the attention backends take it."""
    data = zip(kv_cache.key_caches, kv_cache.value_caches, strict=True)
    if not kv_cache.spec.quantized:
        return [PagedKV(key, value) for key, value in data]
    scales = zip(kv_cache.key_scales, kv_cache.value_scales, strict=True)
    return [PagedKV(key, value, *scale) for (key, value), scale in zip(data, scales, strict=True)]


@dataclass(frozen=True)
class StepLimits:
    max_model_len: int
    max_num_batched_tokens: int


def step_limits(config: EngineConfig, model_config: DecoderConfig) -> StepLimits:
    """The context window and the per-step token budget for this model."""
    max_positions = model_config.max_position_embeddings
    max_model_len = min(config.max_model_len or max_positions, max_positions)
    default_budget = 2048 if config.enable_chunked_prefill else max(2048, max_model_len)
    max_num_batched_tokens = config.max_num_batched_tokens or default_budget
    if not config.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
            f"({max_model_len}) without chunked prefill: a whole prompt is prefilled in one step"
        )
    return StepLimits(max_model_len, max_num_batched_tokens)


def build_kv_cache(
    config: EngineConfig, model: DecoderForCausalLM, device: torch.device, limits: StepLimits,
    backend: KernelBackend, group: TensorParallelGroup | None = None, shared_bytes_per_token: int = 0,
) -> KVCache:  # fmt: skip
    """The KV cache of this rank's KV heads, as many blocks as the budget holds (with tensor parallelism, as many
    as the tightest rank's budget holds: block ids mean the same on every rank). `shared_bytes_per_token`: what
    another cache in the same blocks (a draft model's) takes a token from the same budget."""
    model_config, plan = model.config, model.plan
    spec = KVCacheSpec(
        num_layers=model_config.num_layers,
        num_kv_heads=plan.num_kv_heads,
        head_dim=model_config.head_dim,
        dtype=config.torch_kv_cache_dtype(next(model.parameters()).dtype),
        block_size=config.block_size,
    )
    budget_bytes = kv_cache_budget_bytes(config, model, spec, backend, device, limits.max_num_batched_tokens)
    own_share = spec.bytes_per_token / (spec.bytes_per_token + shared_bytes_per_token)
    num_blocks = spec.num_blocks_for_budget(int(budget_bytes * own_share))
    if group is not None:
        num_blocks = group.min_over_ranks(num_blocks)
    return KVCache.allocate(spec, num_blocks, device)


def log_kv_cache(model: DecoderForCausalLM, kv_cache: KVCache, device: torch.device, model_dir) -> None:
    spec, plan = kv_cache.spec, model.plan
    heads = f", KV heads {plan.first_kv_head}-{plan.first_kv_head + spec.num_kv_heads - 1}" if plan.size > 1 else ""
    logger.info(
        "%sloaded %s (%s, %s on %s); KV cache (%s%s%s): %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes a token)",
        f"rank {plan.rank} of {plan.size}: " if plan.size > 1 else "",
        model_dir, type(model).__name__, next(model.parameters()).dtype, device, spec.dtype,
        " + fp32 scales per token and head" if spec.quantized else "", heads, kv_cache.num_blocks, spec.block_size,
        kv_cache.num_tokens, kv_cache.total_bytes / 2**20, spec.bytes_per_token,
    )  # fmt: skip


def kv_cache_budget_bytes(
    config: EngineConfig,
    model: DecoderForCausalLM,
    spec: KVCacheSpec,
    backend: KernelBackend,
    device: torch.device,
    warmup_tokens: int,
) -> int:
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    activation_peak_bytes = _warmup_peak_bytes(model, spec, backend, device, warmup_tokens)
    _, total_bytes = torch.cuda.mem_get_info(device)
    budget = int(total_bytes * config.gpu_memory_utilization) - activation_peak_bytes
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: the model and a {warmup_tokens}-token step peak at "
            f"{activation_peak_bytes / 2**30:.2f} GiB, over {config.gpu_memory_utilization} x "
            f"{total_bytes / 2**30:.2f} GiB"
        )
    return budget


@dataclass(frozen=True)
class MemoryProbe:
    """The step that sizes the KV cache: whole prompts of at most `max_len` tokens, `num_tokens` in all, each in
    blocks of its own (`num_blocks` of a scratch cache)."""

    plan: StepPlan
    num_blocks: int
    blocks_per_seq: int

    @classmethod
    def of(cls, num_tokens: int, max_len: int, block_size: int) -> "MemoryProbe":
        query_lens = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
        num_seqs, blocks_per_seq = len(query_lens), -(-max(query_lens) // block_size)
        entries = np.array(
            [
                (row, column, row * blocks_per_seq + column)
                for row in range(num_seqs)
                for column in range(blocks_per_seq)
            ],
            dtype=np.int64,
        ).T
        plan = StepPlan(
            input_ids=np.zeros(num_tokens, dtype=np.int64), query_lens=np.array(query_lens, dtype=np.int64),
            seq_lens=np.array(query_lens, dtype=np.int64), rows=np.arange(num_seqs, dtype=np.int64),
            logit_rows=np.array([num_tokens - 1], dtype=np.int64), table_entries=entries, sequence_lens=None,
        )  # fmt: skip
        return cls(plan, num_seqs * blocks_per_seq, blocks_per_seq)

    def inputs(self, block_size: int, device: torch.device) -> StepInputs:
        """The probe's inputs, built as every step's are (its blocks in a scratch cache of `num_blocks`)."""
        plan = self.plan
        buffers = InputBuffers(plan.num_seqs, plan.num_tokens, self.blocks_per_seq, block_size, self.num_blocks, device)
        return buffers.prepare(plan)


@torch.inference_mode()
def _warmup_peak_bytes(model, spec: KVCacheSpec, backend, device, num_tokens: int) -> int:
    """Peak memory of one full-budget prefill (weights and activations), excluding its scratch KV cache.

    The budget is split into prompts no longer than the model's context, so no position exceeds it.
    """
    probe = MemoryProbe.of(num_tokens, model.config.max_position_embeddings, spec.block_size)
    scratch = KVCache.allocate(spec, probe.num_blocks, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    inputs = probe.inputs(spec.block_size, device)
    hidden = model(inputs.input_ids, inputs.positions, paged_kv_layers(scratch), inputs.metadata, backend)
    model.compute_logits(hidden.index_select(0, inputs.logit_rows), backend)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch.total_bytes
    del scratch, hidden
    torch.cuda.empty_cache()
    return peak
