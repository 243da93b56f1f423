"""Scheduler limits."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of the scheduler.

    `watermark_blocks` is kept free at admission so running requests can still grow a little
    before anything must be preempted.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    watermark_blocks: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {self.watermark_blocks}")
