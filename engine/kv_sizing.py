"""How many bytes the KV cache may take: a configured budget, or what the GPU has left after a warm-up."""

import itertools

import torch

from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine.model_runner import paged_kv_layers
from engine.models import DecoderForCausalLM
from kernels import AttentionBackend, AttentionMetadata
from kvcache import KVCache, KVCacheSpec


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
