"""Turns a `SchedulerOutput` into packed tensors and attention metadata, runs the model, returns logits."""

import torch

from engine.models import DecoderForCausalLM
from kernels import AttentionBackend, AttentionMetadata, PagedKV
from kvcache import KVCache
from scheduler import SchedulerOutput


def paged_kv_layers(kv_cache: KVCache) -> list[PagedKV]:
    """Each layer's view of the cache, as the attention backends take it."""
    data = zip(kv_cache.key_caches, kv_cache.value_caches, strict=True)
    if not kv_cache.spec.quantized:
        return [PagedKV(key, value) for key, value in data]
    scales = zip(kv_cache.key_scales, kv_cache.value_scales, strict=True)
    return [PagedKV(key, value, *scale) for (key, value), scale in zip(data, scales, strict=True)]


class ModelRunner:
    def __init__(
        self, model: DecoderForCausalLM, kv_cache: KVCache, backend: AttentionBackend, device: torch.device
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.layer_caches = paged_kv_layers(kv_cache)
        self.backend = backend
        self.device = device
        self.block_size = kv_cache.spec.block_size

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> torch.Tensor:
        """Logits [num_sampling_requests, vocab_size] (fp32) for the scheduled requests that sample, in order."""
        input_ids, positions, metadata = self.prepare_inputs(output)
        hidden = self.model(input_ids, positions, self.layer_caches, metadata, self.backend)
        last_rows = metadata.query_start_loc[1:] - 1
        sampling = torch.tensor([item.samples_next_token for item in output.scheduled], device=self.device)
        return self.model.compute_logits(hidden[last_rows[sampling]])

    def prepare_inputs(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        device = self.device
        token_ids: list[int] = []
        for item in output.scheduled:
            token_ids.extend(item.request.token_ids(item.start_position, item.start_position + item.num_new_tokens))
        query_lens_cpu = [item.num_new_tokens for item in output.scheduled]
        seq_lens_cpu = [item.start_position + item.num_new_tokens for item in output.scheduled]
        max_num_blocks = max(len(item.request.block_ids) for item in output.scheduled)
        block_tables_cpu = [
            item.request.block_ids + [0] * (max_num_blocks - len(item.request.block_ids)) for item in output.scheduled
        ]

        query_lens = torch.tensor(query_lens_cpu, dtype=torch.int32, device=device)
        seq_lens = torch.tensor(seq_lens_cpu, dtype=torch.int32, device=device)
        query_start_loc = torch.zeros(len(query_lens_cpu) + 1, dtype=torch.int32, device=device)
        torch.cumsum(query_lens, dim=0, out=query_start_loc[1:])
        block_tables = torch.tensor(block_tables_cpu, dtype=torch.int32, device=device)

        # Position of every packed token, and the request it belongs to, without a per-token loop.
        num_tokens = len(token_ids)
        seq_index = torch.repeat_interleave(
            torch.arange(len(query_lens_cpu), device=device), query_lens, output_size=num_tokens
        )
        first_positions = (seq_lens - query_lens)[seq_index]
        positions = torch.arange(num_tokens, device=device) - query_start_loc[:-1][seq_index] + first_positions
        block_ids = block_tables[seq_index, positions // self.block_size].long()
        slot_mapping = block_ids * self.block_size + positions % self.block_size

        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            query_lens_cpu=query_lens_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        return input_ids, positions.long(), metadata
