"""The KV cache's size: a configured byte budget, or what the GPU has left after a warm-up; and the step limits."""

import itertools
import logging
from dataclasses import dataclass

import torch

from kvserve.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from kvserve.engine.model_runner import paged_kv_layers
from kvserve.engine.models import DecoderConfig, DecoderForCausalLM
from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.kernels import AttentionBackend, AttentionMetadata, AttentionShape, select_attention_backend
from kvserve.kvcache import KVCache, KVCacheSpec

logger = logging.getLogger(__name__)


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
    group: TensorParallelGroup | None = None,
) -> tuple[KVCache, AttentionBackend]:  # fmt: skip
    """The KV cache of this rank's KV heads, as many blocks as the budget holds (with tensor parallelism, as many
    as the tightest rank's budget holds: block ids mean the same on every rank), and the attention backend."""
    model_config, plan = model.config, model.plan
    spec = KVCacheSpec(
        num_layers=model_config.num_layers,
        num_kv_heads=plan.num_kv_heads,
        head_dim=model_config.head_dim,
        dtype=config.torch_kv_cache_dtype(next(model.parameters()).dtype),
        block_size=config.block_size,
    )
    shape = AttentionShape(config.max_num_seqs, plan.num_heads, model_config.head_dim)
    backend = select_attention_backend(config.attention_backend, device, shape)
    budget_bytes = kv_cache_budget_bytes(config, model, spec, backend, device, limits.max_num_batched_tokens)
    num_blocks = spec.num_blocks_for_budget(budget_bytes)
    if group is not None:
        num_blocks = group.min_over_ranks(num_blocks)
    return KVCache.allocate(spec, num_blocks, device), backend


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
    backend: AttentionBackend,
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


def prefill_batch(num_tokens: int, max_len: int, block_size: int, device: torch.device):
    """Whole prompts of at most `max_len` tokens, `num_tokens` in all, each in blocks of its own:
    (positions, attention metadata, number of blocks they take)."""
    query_lens = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
    blocks_per_seq = -(-max(query_lens) // block_size)
    num_blocks = blocks_per_seq * len(query_lens)
    block_tables = torch.arange(num_blocks, dtype=torch.int32, device=device).view(len(query_lens), blocks_per_seq)
    lens = torch.tensor(query_lens, device=device)
    seq_index = torch.repeat_interleave(torch.arange(len(query_lens), device=device), lens, output_size=num_tokens)
    positions = torch.cat([torch.arange(n, device=device) for n in query_lens])
    slot_mapping = block_tables[seq_index, positions // block_size].long() * block_size + positions % block_size
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device),
        seq_lens=lens.to(torch.int32),
        block_tables=block_tables,
        query_lens_cpu=query_lens,
        seq_lens_cpu=query_lens,
    )
    return positions, metadata, num_blocks


@torch.inference_mode()
def _warmup_peak_bytes(model, spec: KVCacheSpec, backend, device, num_tokens: int) -> int:
    """Peak memory of one full-budget prefill (weights and activations), excluding its scratch KV cache.

    The budget is split into prompts no longer than the model's context, so no position exceeds it.
    """
    positions, metadata, num_blocks = prefill_batch(
        num_tokens, model.config.max_position_embeddings, spec.block_size, device
    )
    scratch = KVCache.allocate(spec, num_blocks, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model(input_ids, positions, paged_kv_layers(scratch), metadata, backend)
    model.compute_logits(hidden[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch.total_bytes
    del scratch, hidden
    torch.cuda.empty_cache()
    return peak
