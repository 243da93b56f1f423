"""Turns a `SchedulerOutput` into model inputs, runs the model (or replays a captured decode graph),
and returns the logits of the requests that sample."""

import time

import torch

from kvserve.engine.decode_graphs import CudaGraph, DecodeGraphs
from kvserve.engine.models import DecoderForCausalLM
from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.engine.parallel.step_message import StepMessage
from kvserve.engine.sampler import to_device
from kvserve.engine.step_inputs import InputBuffers, StepInputs
from kvserve.kernels import AttentionBackend, PagedKV
from kvserve.kvcache import KVCache
from kvserve.scheduler import Request, ScheduledRequest, SchedulerOutput


def paged_kv_layers(kv_cache: KVCache) -> list[PagedKV]:
    """Each layer's view of the cache, as the attention backends take it."""
    data = zip(kv_cache.key_caches, kv_cache.value_caches, strict=True)
    if not kv_cache.spec.quantized:
        return [PagedKV(key, value) for key, value in data]
    scales = zip(kv_cache.key_scales, kv_cache.value_scales, strict=True)
    return [PagedKV(key, value, *scale) for (key, value), scale in zip(data, scales, strict=True)]


class ModelRunner:
    def __init__(
        self, model: DecoderForCausalLM, kv_cache: KVCache, backend: AttentionBackend, device: torch.device,
        max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, group: TensorParallelGroup | None = None,
    ) -> None:  # fmt: skip
        """With a tensor-parallel `group` (on rank 0), each step is sent to the other ranks before it runs here."""
        self.model = model
        self.group = group
        self.kv_cache = kv_cache
        self.layer_caches = paged_kv_layers(kv_cache)
        self.backend = backend
        self.device = device
        self.max_model_len = max_model_len
        block_size = kv_cache.spec.block_size
        # A padded decode batch has up to max_num_seqs tokens, maybe more than the token budget.
        self.inputs = InputBuffers(
            max_num_seqs, max(max_num_batched_tokens, max_num_seqs), -(-max_model_len // block_size), block_size,
            kv_cache.padding_block, device, long_rope=model.model.rotary.long_rope,
        )  # fmt: skip
        self.decode_graphs: DecodeGraphs | None = None

    @torch.inference_mode()
    def capture_decode_graphs(self, sizes: list[int], kind=CudaGraph) -> None:
        """Capture pure-decode forwards at `sizes` (CUDA graphs; `kind` may stand in another replay)."""
        self.decode_graphs = DecodeGraphs.capture(self.forward, self.inputs, sizes, self.max_model_len, kind)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Run a prompt chunk, then a decode beside a chunk, in the padding block alone, so every kernel
        variant a step launches is compiled before the first request; returns the seconds it took."""
        start_s = time.monotonic()
        size = self.kv_cache.spec.block_size
        chunk = Request("warm-up-chunk", prompt_token_ids=[0] * size, block_ids=[self.kv_cache.padding_block])
        decode = Request("warm-up-decode", prompt_token_ids=[0, 0], num_computed_tokens=1, block_ids=chunk.block_ids)
        for scheduled in ([chunk], [decode, chunk]):
            self.execute(
                SchedulerOutput([ScheduledRequest.of(request, request.num_uncomputed_tokens) for request in scheduled])
            )
            if self.device.type == "cuda":  # the host buffers are rewritten only once the device has read them
                torch.cuda.synchronize(self.device)
        for request in (chunk, decode):
            self.inputs.block_tables.release(request.request_id)
        return time.monotonic() - start_s

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, extra_rows: list[int] | None = None) -> torch.Tensor:
        """Logits [num_sampling_requests + len(extra_rows), vocab_size] (fp32): first those of the scheduled
        requests that sample, in order, then those of `extra_rows` (indices into the step's tokens)."""
        graph_size = self.decode_graphs.size_for(output) if self.decode_graphs is not None else None
        inputs = self.inputs.prepare(output, num_padded_seqs=graph_size)
        if self.group is not None:
            StepMessage.of_prepared(self.inputs, extra_rows).send(self.group)
        hidden = self.forward(inputs) if graph_size is None else self.decode_graphs.replay(graph_size)
        rows = inputs.sample_rows
        if extra_rows:
            rows = torch.cat([rows, to_device(extra_rows, torch.long, self.device)])
        return self.model.compute_logits(hidden.index_select(0, rows))

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.layer_caches, inputs.metadata, self.backend)
