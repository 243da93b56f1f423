"""A worker rank (1..N-1) of a tensor-parallel engine: its shard of the model and its KV heads' cache,
stepping whenever rank 0's step message arrives, until rank 0 says stop.

It runs the same forward as rank 0 on the same tokens, so every collective lines up: the all-reduces
of each layer, then the gather of the LM head's logits on rank 0, which samples. A worker keeps no
request state: block tables come with each step.
"""

import ctypes
import logging
import signal
import sys
from pathlib import Path

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.default_model import default_model_dir
from kvserve.engine.kv_sizing import build_kv_cache, log_kv_cache, step_limits
from kvserve.engine.model_loader import checkpoint_dtype, load_model
from kvserve.engine.model_runner import paged_kv_layers
from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.engine.parallel.launch import WorkerSpec, cpu_threads_per_rank, launched_spec, rank_device
from kvserve.engine.parallel.step_message import StepMessage

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def run_launched_worker(config: EngineConfig) -> None:
    """A rank launched from outside (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): serve rank 0's steps."""
    model_dir = Path(config.model) if config.model else default_model_dir()
    run_worker(launched_spec(config, str(model_dir)))


def run_worker(spec: WorkerSpec) -> None:
    """The worker's whole life: join the group, build the shard, step until told to stop."""
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
        _serve_steps(spec, group, device)
    finally:
        group.leave()


@torch.inference_mode()
def _serve_steps(spec: WorkerSpec, group: TensorParallelGroup, device: torch.device) -> None:
    config = spec.config
    dtype = config.torch_dtype(device, checkpoint_dtype(spec.model_dir))
    model = load_model(spec.model_dir, dtype, device, group)
    kv_cache, backend = build_kv_cache(config, model, device, step_limits(config, model.config), group)
    log_kv_cache(model, kv_cache, device, spec.model_dir)
    layer_caches = paged_kv_layers(kv_cache)
    long_rope = model.model.rotary.long_rope
    while (message := StepMessage.receive(group)) is not None:
        inputs = message.step_inputs(device, config.block_size, long_rope)
        hidden = model(inputs.input_ids, inputs.positions, layer_caches, inputs.metadata, backend)
        model.compute_logits(hidden.index_select(0, inputs.sample_rows))


def _die_with_parent() -> None:
    """A spawned rank is killed when rank 0's process ends, however it ends (Linux), so none is left behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
