"""Pure-decode forwards captured as CUDA graphs, one per batch size of a ladder, and replayed.

A decode step launches a few hundred kernels of a few microseconds each; replaying a captured graph
launches them all at once. A step whose requests all compute one token is padded to the next size
of the ladder (its `StepPlan` adds padding sequences, which read and write only the padding block) and
replays that size's graph, which reads the persistent input buffers. A step that verifies drafts replays one
too: its plan makes each of a request's tokens (its last one and its drafts) a decode of its own, with the context
up to its position (the step stores every token's K and V before any attends), so the graph of the step's token
count runs it. Other steps (prompt chunks) run
eagerly. Every rank captures the same ladder and replays the size rank 0's plan names, so a graph's
collectives (tensor parallelism) line up as an eager step's do.

The graph does not depend on CUDA to be tested: `EagerReplay` runs the same forward again on the
same buffers, so the padding and buffer logic is exercised on a CPU.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvserve.engine.step_inputs import InputBuffers, StepInputs
from kvserve.engine.step_plan import StepPlan
from kvserve.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

Forward = Callable[[StepInputs], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including `max_num_seqs`."""
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class CudaGraph:
    """One captured forward; replay() rewrites its output tensor."""

    def __init__(self, forward: Forward, inputs: StepInputs, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = forward(inputs)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class EagerReplay:
    """Stands in for a CUDA graph where there is none: runs the forward again on the same buffers."""

    def __init__(self, forward: Forward, inputs: StepInputs, pool) -> None:
        self.forward, self.inputs = forward, inputs
        self.output = forward(inputs)

    def replay(self) -> torch.Tensor:
        self.output = self.forward(self.inputs)
        return self.output


@dataclass
class DecodeGraphs:
    graphs: dict[int, CudaGraph | EagerReplay]

    @classmethod
    def capture(
        cls, forward: Forward, buffers: InputBuffers, sizes: list[int], max_model_len: int, kind=CudaGraph
    ) -> "DecodeGraphs":
        """Warm each size up eagerly (so kernels compile outside the capture), then capture it, largest first
        so the smaller graphs reuse its memory pool."""
        start_s = time.monotonic()
        pool = torch.cuda.graph_pool_handle() if kind is CudaGraph else None
        graphs = {}
        for size in sorted(sizes, reverse=True):
            ones, long_rope = [1] * size, buffers.long_rope is not None
            padding = StepPlan.in_padding_block(ones, ones, buffers.block_tables.padding_row, long_rope)
            inputs = buffers.prepare(replace(padding, graph_size=size))
            # Kernels that size their launch by the longest context see the longest possible one.
            metadata = replace(inputs.metadata, seq_lens_cpu=[max_model_len] * size)
            inputs = replace(inputs, metadata=metadata)
            forward(inputs)
            graphs[size] = kind(forward, inputs, pool)
        if kind is CudaGraph:
            torch.cuda.synchronize()
        logger.info("captured decode graphs for batch sizes %s in %.1f s", sorted(graphs), time.monotonic() - start_s)
        return cls(graphs)

    def size_for(self, output: SchedulerOutput) -> int:
        """The graph size a step replays: the smallest at least its tokens, if every request decodes (one token, or
        its last token and its drafts: the plan then makes each token a decode of its own); 0 (run eagerly)
        otherwise."""
        scheduled = output.scheduled
        if not scheduled or any(item.num_new_tokens != 1 + item.num_draft_tokens for item in scheduled):
            return 0
        num_tokens = output.num_batched_tokens
        return min((size for size in self.graphs if size >= num_tokens), default=0)

    def replay(self, size: int) -> torch.Tensor:
        return self.graphs[size].replay()
