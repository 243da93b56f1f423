"""Starting the ranks of a tensor-parallel engine, from rank 0.

On one machine kvserve spawns ranks 1..N-1 itself (torch multiprocessing, spawn) and they meet on a
loopback port. Across machines every rank is started from outside, as torchrun or a Kubernetes
StatefulSet does, with MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (LOCAL_RANK picks the GPU); rank 0
serves HTTP and the others run the worker loop (`kvserve serve` does either). A model that cannot be
split that way, or more ranks than GPUs, is refused before any rank starts.
"""

import logging
import os
import socket
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.multiprocessing as mp

from kvserve.engine.config import EngineConfig
from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.engine.parallel.sharding import ShardPlan, TensorParallelError
from kvserve.engine.step_plan import send_stop

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # how long stopped workers get to leave before they are killed


@dataclass(frozen=True)
class RankSpec:
    """What a worker rank needs to build its shard: the engine's settings and where to meet rank 0."""

    config: EngineConfig
    model_dir: str
    rank: int
    size: int
    init_method: str
    local_rank: int  # which GPU, on CUDA
    spawned: bool  # started by rank 0 (and so ends with it)


def launched_rank() -> int | None:
    """This process's RANK when the ranks are launched from outside (torchrun-style variables), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"])


def launched_spec(config: EngineConfig, model_dir: str) -> RankSpec:
    """The spec of a rank launched from outside, from the environment (checked against the settings)."""
    size = int(os.environ["WORLD_SIZE"])
    if size != config.tensor_parallel_size:
        raise TensorParallelError(f"WORLD_SIZE={size} but tensor_parallel_size is {config.tensor_parallel_size}")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return RankSpec(config, model_dir, rank, size, "env://", local_rank, spawned=False)


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    device = config.torch_device()
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def check_can_split(config: EngineConfig, model_dir: Path, device: torch.device) -> None:
    """`TensorParallelError` unless the model splits over the ranks and, on CUDA, each rank has a GPU."""
    from kvserve.engine.compressed_tensors_checkpoint import check_splits_groups, quantization_config
    from kvserve.engine.gguf_checkpoint import check_splits_blocks, find_gguf
    from kvserve.engine.model_loader import (
        load_decoder_config,  # the loader imports the decoder, which imports this package
    )

    decoder_config = load_decoder_config(model_dir)
    ShardPlan.of(decoder_config, 0, config.tensor_parallel_size)
    gguf_path = find_gguf(model_dir)
    if gguf_path is not None:
        check_splits_blocks(gguf_path, config.tensor_parallel_size)
    else:
        quantization = quantization_config(model_dir)
        if quantization is not None:
            check_splits_groups(quantization, decoder_config, config.tensor_parallel_size)
    if device.type == "cuda" and torch.cuda.device_count() < config.tensor_parallel_size:
        raise TensorParallelError(
            f"tensor_parallel_size {config.tensor_parallel_size} needs as many GPUs; "
            f"this machine has {torch.cuda.device_count()}"
        )


@dataclass
class Ranks:
    """Rank 0's view of the group: the processes it spawned (none when the ranks were launched from outside)."""

    group: TensorParallelGroup
    processes: list[BaseProcess] = field(default_factory=list)
    stopped: bool = False

    def failure(self) -> str | None:
        """A message naming the first spawned rank that exited unasked, or None while all run."""
        if self.stopped:
            return None
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return f"tensor-parallel rank {rank} (pid {process.pid}) exited with status {process.exitcode}"
        return None

    def stop(self) -> None:
        """Tell the workers to leave their loop, wait for them (killing stragglers), and leave the group."""
        if self.stopped:
            return
        if self.failure() is None:
            try:
                send_stop(self.group)
            except RuntimeError as error:  # a rank is gone or hung: it is killed below
                logger.warning("could not tell every rank to stop: %s", error)
        for process in self.processes:
            process.join(timeout=STOP_TIMEOUT_S)
        self.kill()

    def kill(self) -> None:
        """End the spawned ranks now (no goodbye: they may not be listening) and leave the group."""
        self.stopped = True
        self.kill_processes()
        self.group.leave()

    def kill_processes(self) -> None:
        _kill(self.processes)


def start_ranks(config: EngineConfig, model_dir: Path, device: torch.device) -> Ranks:
    """Rank 0: check the split, start (or meet) the other ranks, and join the group with them."""
    check_can_split(config, model_dir, device)
    size = config.tensor_parallel_size
    if launched_rank() is not None:
        spec = launched_spec(config, str(model_dir))
        if spec.rank != 0:
            raise TensorParallelError(f"RANK={spec.rank}: only rank 0 runs the engine (the others: `kvserve serve`)")
        return Ranks(TensorParallelGroup.join(0, size, spec.init_method, device, config.tensor_parallel_timeout_s))
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(size))
    from kvserve.engine.parallel.rank_process import run_rank  # it imports this module: a top-level import cycles

    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.get_context("spawn")
    specs = [RankSpec(config, str(model_dir), rank, size, init_method, rank, spawned=True) for rank in range(1, size)]
    processes = [
        context.Process(target=run_rank, args=(spec,), name=f"kvserve-tp-rank-{spec.rank}", daemon=True)
        for spec in specs
    ]
    for process in processes:
        process.start()
    try:
        group = TensorParallelGroup.join(0, size, init_method, device, config.tensor_parallel_timeout_s)
    except BaseException:
        _kill(processes)
        raise
    logger.info("tensor parallel: %d ranks (pids %s)", size, ", ".join(str(p.pid) for p in processes))
    return Ranks(group, processes)


def _kill(processes: list[BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=STOP_TIMEOUT_S)


def cpu_threads_per_rank(size: int) -> int:
    """The machine's cores shared out between the ranks on it (at least one each)."""
    return max(1, len(os.sched_getaffinity(0)) // size)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
