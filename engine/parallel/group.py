"""The ranks of a tensor-parallel engine and what they exchange: activations (all-reduce), the LM head's
logits (gathered on rank 0, which samples), and each step's plan from rank 0 (engine/step_plan.py).

Activations go over the device's backend (NCCL on CUDA, gloo on a CPU); step messages always go over
gloo, on the host, so a worker learns a step's shape without a device round trip. Every collective of a
step has the group's timeout: a rank that died or hangs makes the others' next collective fail within it.
Only a worker's wait for the next step is unbounded.
"""

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# Ranks start, import torch and load their shards at their own pace: meeting and agreeing on the cache size may
# take minutes on a loaded machine, where a step's collective that takes `timeout_s` means a rank is gone.
START_UP_TIMEOUT_S = 600.0
# A worker waits for the next step as long as the server stays idle. (If rank 0 dies, its connections close and the
# wait fails at once.)
IDLE_TIMEOUT = timedelta(days=365)


class CollectiveProgress:
    """When this rank last finished a collective or began a step: what rank 0's step watchdog watches
    (engine/parallel/watchdog.py)."""

    def __init__(self) -> None:
        self.last_s = time.monotonic()

    def mark(self) -> None:
        self.last_s = time.monotonic()


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int
    device_group: dist.ProcessGroup  # activations and logits, with the step timeout
    host_group: dist.ProcessGroup  # step messages (gloo), with the step timeout
    start_up_group: dist.ProcessGroup  # gloo, with START_UP_TIMEOUT_S: what the ranks settle before serving
    next_step_group: dist.ProcessGroup  # gloo, with IDLE_TIMEOUT: the header announcing each step
    timeout_s: float
    progress: CollectiveProgress = field(default_factory=CollectiveProgress, compare=False)

    @classmethod
    def join(
        cls, rank: int, size: int, init_method: str, device: torch.device, timeout_s: float
    ) -> "TensorParallelGroup":
        """Join the group (every rank calls this; it returns once all have, or fails after START_UP_TIMEOUT_S)."""
        start_up_timeout = timedelta(seconds=max(timeout_s, START_UP_TIMEOUT_S))
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=start_up_timeout)
        timeout = timedelta(seconds=timeout_s)
        host_group = dist.new_group(backend="gloo", timeout=timeout)
        device_group = dist.new_group(backend="nccl", timeout=timeout) if device.type == "cuda" else host_group
        next_step_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        return cls(rank, size, device_group, host_group, dist.group.WORLD, next_step_group, timeout_s)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place."""
        dist.all_reduce(tensor, group=self.device_group)
        self.progress.mark()
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The largest over the ranks, in place."""
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.device_group)
        self.progress.mark()
        return tensor

    def gather_on_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape on each), on rank 0, by rank; None elsewhere."""
        if self.rank != 0:
            dist.gather(tensor, None, dst=0, group=self.device_group)
            self.progress.mark()
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.gather(tensor, parts, dst=0, group=self.device_group)
        self.progress.mark()
        return parts

    def min_over_ranks(self, value: int) -> int:
        """The smallest of the ranks' `value`s, on every rank (at start-up: each rank gets there after its load)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.start_up_group)
        return int(tensor.item())

    def broadcast_from_first(self, tensor: torch.Tensor, announces_step: bool = False) -> torch.Tensor:
        """Rank 0's host `tensor` into every rank's `tensor` (same shape and dtype). What `announces_step` is waited
        for without a timeout: the server may idle for hours between steps."""
        dist.broadcast(tensor, src=0, group=self.next_step_group if announces_step else self.host_group)
        self.progress.mark()
        return tensor

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
