"""ModelRunner: rank 0's side of every step. It plans the step from the scheduler's output (`StepPlanner`), sends
the plan to the other ranks with tensor parallelism, and runs it on its own `Worker`, as every rank does."""

import torch

from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.engine.step_plan import StepPlanner
from kvserve.engine.worker import Worker
from kvserve.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, worker: Worker, max_num_seqs: int, group: TensorParallelGroup | None = None) -> None:
        self.worker = worker
        self.group = group
        self.planner = StepPlanner(max_num_seqs, long_rope=worker.inputs.long_rope is not None)

    def release(self, request_ids: list[str]) -> None:
        """These requests left the running batch in a step that runs nothing: their block-table rows are free (a step
        that runs something frees them as it plans)."""
        self.planner.table_rows.release(request_ids)

    def execute(
        self, output: SchedulerOutput, extra_logit_rows: list[int] | None = None, lora_slots: list[int] | None = None
    ) -> torch.Tensor:
        """Logits [num_sampling_rows + len(extra_logit_rows), vocab_size] (fp32): first those of the scheduled
        requests that sample, in order (one each, or 1 + its draft tokens for a request with drafts), then those of
        `extra_logit_rows` (indices into the step's tokens).
        `lora_slots`: each scheduled request's adapter slot (-1: the base model), when the engine serves adapters."""
        graphs = self.worker.decode_graphs
        graph_size = graphs.size_for(output) if graphs is not None else 0
        plan = self.planner.plan(output, extra_logit_rows, graph_size, lora_slots)
        if self.group is not None:
            plan.send(self.group)
        return self.worker.execute(plan)
