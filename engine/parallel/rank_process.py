"""The life of a tensor-parallel rank other than 0: join the group, build its `Worker` (the same as rank 0's: its
shard of the weights and its KV heads' cache), and run each step rank 0's plan announces, until rank 0 says stop.

A rank keeps no request state: the plan carries the tokens and the block-table entries added since the last step.
"""

import ctypes
import logging
import signal
import sys
from pathlib import Path

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.default_model import default_model_dir
from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.engine.parallel.launch import RankSpec, cpu_threads_per_rank, launched_spec, rank_device
from kvserve.engine.startup import StartupProgress
from kvserve.engine.step_plan import StepPlan
from kvserve.engine.worker import Worker

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def run_launched_rank(config: EngineConfig) -> None:
    """A rank launched from outside (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): serve rank 0's steps."""
    model_dir = Path(config.model) if config.model else default_model_dir()
    run_rank(launched_spec(config, str(model_dir)))


def run_rank(spec: RankSpec) -> None:
    """The rank's whole life: join the group, build the worker, step until told to stop."""
    if spec.spawned:
        _die_with_parent()
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = spec.config
    device = rank_device(config, spec.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif spec.spawned:
        torch.set_num_threads(cpu_threads_per_rank(spec.size))
    group = TensorParallelGroup.join(spec.rank, spec.size, spec.init_method, device, config.tensor_parallel_timeout_s)
    try:
        worker = Worker.load(config, Path(spec.model_dir), device, group, StartupProgress(f"rank {spec.rank}"))
        while (plan := StepPlan.receive(group)) is not None:
            worker.execute(plan)
    finally:
        group.leave()


def _die_with_parent() -> None:
    """A spawned rank is killed when rank 0's process ends, however it ends (Linux), so none is left behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
