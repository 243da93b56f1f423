"""Worker: one rank's part of the model, its KV heads' cache, its step inputs and its captured decode graphs.

Every rank builds and runs the same worker. Rank 0's `ModelRunner` plans each step from the scheduler's output
and, with tensor parallelism, sends the plan to the other ranks; each rank's worker runs it: inputs written from
the plan (`InputBuffers`, the one builder of attention metadata), then the forward, eagerly or by replaying the
graph of the size the plan names, then the logits of the rows it asks for (gathered on rank 0). So the ranks meet
in the same collectives in the same order, at start-up (cache sizing, warm-up, graph capture) as in every step.
"""

import logging
import time
from pathlib import Path

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.decode_graphs import CudaGraph, DecodeGraphs, EagerReplay, capture_sizes
from kvserve.engine.kv_sizing import StepLimits, build_kv_cache, log_kv_cache, paged_kv_layers, step_limits
from kvserve.engine.lora.model_slots import ModelLoraSlots
from kvserve.engine.lora.peft_adapter import LoraAdapter
from kvserve.engine.model_loader import checkpoint_dtype, load_model, prepare_weights
from kvserve.engine.models import DecoderForCausalLM
from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.engine.pooling import read_pooling_config
from kvserve.engine.startup import StartupProgress
from kvserve.engine.step_inputs import InputBuffers, StepInputs
from kvserve.engine.step_plan import StepPlan
from kvserve.kernels import AttentionShape, KernelBackend, select_backend
from kvserve.kernels.lora import LoraBatch
from kvserve.kvcache import KVCache

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self, model: DecoderForCausalLM, kv_cache: KVCache, backend: KernelBackend, limits: StepLimits,
        max_num_seqs: int, device: torch.device, lora_slots: ModelLoraSlots | None = None,
        returns_hidden: bool = False,
    ) -> None:  # fmt: skip
        """`lora_slots`: the model's adapter slots, when the engine serves adapters. `returns_hidden`: a step returns
        the final norm's hidden states of the rows asked for, not their logits (an embedding model)."""
        self.model, self.kv_cache, self.backend, self.limits, self.device = model, kv_cache, backend, limits, device
        self.returns_hidden = returns_hidden
        self.layer_caches = paged_kv_layers(kv_cache)
        self.lora_slots = lora_slots
        self.max_num_seqs = max_num_seqs
        block_size = kv_cache.spec.block_size
        # A padded decode batch has up to max_num_seqs tokens, maybe more than the token budget.
        self.inputs = InputBuffers(
            max_num_seqs, max_num_tokens(limits, max_num_seqs), -(-limits.max_model_len // block_size),
            block_size, kv_cache.padding_block, device, long_rope=model.model.rotary.long_rope,
            lora=lora_slots.batch if lora_slots is not None else None,
        )  # fmt: skip
        self.decode_graphs: DecodeGraphs | None = None

    @classmethod
    def load(
        cls, config: EngineConfig, model_dir: Path, device: torch.device, group: TensorParallelGroup | None = None,
        progress: StartupProgress | None = None, draft_kv_bytes_per_token: int = 0,
    ) -> "Worker":  # fmt: skip
        """This rank's worker, ready to step: its shard loaded, the KV cache sized (as the tightest rank's budget
        allows, less a draft model's cache in the same blocks), kernels warmed up and decode graphs captured where
        the config and the device call for them; each phase logged through `progress`."""
        progress = progress or StartupProgress()
        with progress.phase("loading weights"):
            model = load_model(model_dir, config.torch_dtype(device, checkpoint_dtype(model_dir)), device, group)
        shape = AttentionShape(config.max_num_seqs, model.plan.num_heads, model.config.head_dim)
        with progress.phase("loading the kernels"):  # on a CPU, the C++ kernels are built here the first time
            backend = select_backend(config.attention_backend, device, shape)
            prepare_weights(model, backend)
        limits = step_limits(config, model.config)
        lora_slots = None
        if config.enable_lora:  # before the KV cache is sized, so the slots' memory is counted
            batch = LoraBatch(max_num_tokens(limits, config.max_num_seqs), config.max_loras, device, backend.lora_tiled)
            dtype = next(model.parameters()).dtype
            lora_slots = ModelLoraSlots(model, config.max_loras, config.max_lora_rank, batch, dtype, device)
            logger.info(
                "LoRA: %d adapter slots of rank %d in every adaptable layer (%.1f MiB)", config.max_loras,
                config.max_lora_rank, lora_slots.nbytes / 2**20,
            )  # fmt: skip
        with progress.phase("sizing the KV cache"):
            kv_cache = build_kv_cache(config, model, device, limits, backend, group, draft_kv_bytes_per_token)
        log_kv_cache(model, kv_cache, device, model_dir)
        embeds = read_pooling_config(model_dir, config.task, config.pooling, config.normalize) is not None
        worker = cls(model, kv_cache, backend, limits, config.max_num_seqs, device, lora_slots, embeds)
        if device.type == "cuda":
            with progress.phase("compiling and warming up the kernels"):
                worker.warm_up()
        if config.eager_graph_replay:
            with progress.phase("capturing decode graphs (eager replay)"):
                worker.capture_decode_graphs(capture_sizes(config.max_num_seqs), kind=EagerReplay)
        elif device.type == "cuda" and not config.enforce_eager:
            with progress.phase("capturing CUDA graphs"):
                worker.capture_decode_graphs(capture_sizes(config.max_num_seqs))
        return worker

    @torch.inference_mode()
    def write_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter into a slot of the model's adapter layers (rank 0's engine core decides which)."""
        self.lora_slots.write(slot, adapter)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Logits [len(plan.logit_rows), vocab_size] (fp32) of the rows the plan names; None on ranks other than 0
        with tensor parallelism (rank 0 gathers every rank's vocabulary rows)."""
        inputs = self.inputs.prepare(plan)
        hidden = self.decode_graphs.replay(plan.graph_size) if plan.graph_size else self.forward(inputs)
        if self.returns_hidden:  # every rank holds the whole hidden state: no gather
            return hidden.index_select(0, inputs.logit_rows)
        return self.model.compute_logits(hidden.index_select(0, inputs.logit_rows), self.backend)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.layer_caches, inputs.metadata, self.backend)

    @torch.inference_mode()
    def capture_decode_graphs(self, sizes: list[int], kind=CudaGraph) -> None:
        """Capture pure-decode forwards at `sizes` (CUDA graphs; `kind` may stand in another replay)."""
        self.decode_graphs = DecodeGraphs.capture(self.forward, self.inputs, sizes, self.limits.max_model_len, kind)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Run a prompt chunk, then a decode beside a chunk (a decode alone where a step holds one sequence), in
        the padding block alone, so every kernel variant a step launches is compiled before the first request;
        returns the seconds it took."""
        start_s = time.monotonic()
        size, padding_row = self.kv_cache.spec.block_size, self.inputs.block_tables.padding_row
        long_rope = self.inputs.long_rope is not None
        chunk = StepPlan.in_padding_block([size], [size], padding_row, long_rope, logit_rows=(size - 1,))
        if self.max_num_seqs >= 2:
            decode = StepPlan.in_padding_block([1, size], [2, size], padding_row, long_rope, (0, size))
        else:
            decode = StepPlan.in_padding_block([1], [2], padding_row, long_rope, (0,))
        for plan in (chunk, decode):
            self.execute(plan)
            if self.device.type == "cuda":  # the host buffers are rewritten only once the device has read them
                torch.cuda.synchronize(self.device)
        return time.monotonic() - start_s


def max_num_tokens(limits: StepLimits, max_num_seqs: int) -> int:
    """The most tokens a step runs: a padded decode batch has up to max_num_seqs, maybe more than the token budget."""
    return max(limits.max_num_batched_tokens, max_num_seqs)
