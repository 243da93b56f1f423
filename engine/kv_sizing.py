"""How many bytes the KV cache may take: a configured budget, or what the GPU has left after a warm-up."""

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


@torch.inference_mode()
def _warmup_peak_bytes(model, spec: KVCacheSpec, backend, device, num_tokens: int) -> int:
    """Peak memory of one full-budget prefill (weights and activations), excluding its scratch KV cache."""
    num_blocks = -(-num_tokens // spec.block_size)
    scratch = KVCache.allocate(spec, num_blocks, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    positions = torch.arange(num_tokens, device=device)
    metadata = AttentionMetadata(
        slot_mapping=positions,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        query_lens_cpu=[num_tokens],
        seq_lens_cpu=[num_tokens],
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model(input_ids, positions, paged_kv_layers(scratch), metadata, backend)
    model.compute_logits(hidden[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch.total_bytes
    del scratch, hidden
    torch.cuda.empty_cache()
    return peak
