"""Decode step time with CUDA graphs and eagerly, and the kernels one eager decode step launches.

A Qwen3-0.6B-shaped model (random weights, bf16) decodes batches of 1, 8, 64 and 256 requests
(512-token prompts): the median time of `engine.step()` over 30 decode steps (everything a step
does: scheduling, inputs, forward, sampling, the transfer back, outputs), with the decode graphs
and with `enforce_eager`. Then one eager decode step of the largest batch under the profiler: the
CUDA kernels it launches, in all and per layer.

    python -m benchmarks.gpu_step_bench            # CUDA
    python -m benchmarks.gpu_step_bench --smoke    # a tiny model on a CPU, to check the script
"""

import argparse
from pathlib import Path

import torch

from benchmarks.checkpoints import QWEN3_0_6B_SHAPE, SMOKE_SHAPE, kv_bytes_per_token, qwen3_shaped_dir
from benchmarks.harness import median_ms
from kvserve.engine import LLM, SamplingParams

BLOCK_SIZE = 16
WARMUP_STEPS = 3


def decoding_engine(model_dir: Path, shape: dict, batch: int, prompt_len: int, num_steps: int, eager: bool,
                    device: torch.device) -> LLM:  # fmt: skip
    """An engine whose `batch` requests have all prefilled their prompts and decode from here on."""
    total_tokens = prompt_len + num_steps + WARMUP_STEPS + 1
    # A cache that holds every request to its last step, with a block of slack each (and the padding block the
    # decode graphs write to): none waits or is preempted.
    num_blocks = batch * (-(-total_tokens // BLOCK_SIZE) + 1) + 1
    kv_bytes = num_blocks * BLOCK_SIZE * kv_bytes_per_token(shape, 2 if device.type == "cuda" else 4)
    settings = {"max_num_seqs": batch, "enforce_eager": eager, "block_size": BLOCK_SIZE,
                "kv_cache_memory_bytes": kv_bytes}  # fmt: skip
    if device.type == "cuda":
        settings["dtype"] = "bfloat16"
    llm = LLM(str(model_dir), **settings)
    params = SamplingParams(max_tokens=total_tokens - prompt_len, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        llm.engine.add_request([100 + (i + j) % 5000 for j in range(prompt_len)], params)
    # Each prefill step takes at least one whole prompt: more steps than requests means something is stuck.
    for _ in range(batch + 1):
        scheduler = llm.engine.core.scheduler
        if not scheduler.waiting and all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in scheduler.running):
            return llm
        llm.engine.step()
    raise RuntimeError(f"{batch} prompts of {prompt_len} tokens were not prefilled in {batch + 1} steps")


def step_ms(llm: LLM, num_steps: int) -> float:
    # A step ends with the sampled tokens on the host: the device is done when it returns.
    return median_ms(llm.engine.step, repeats=num_steps, warmup=WARMUP_STEPS)


def kernels_per_step(llm: LLM) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.engine.step()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model on whatever device there is")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SMOKE_SHAPE if args.smoke else QWEN3_0_6B_SHAPE
    model_dir = qwen3_shaped_dir(shape)
    batches, prompt_len, num_steps = ([1, 4], 16, 5) if args.smoke else ([1, 8, 64, 256], 512, 30)
    print(f"{model_dir.name} on {device}; decode steps after {prompt_len}-token prompts, median of {num_steps}")
    print(f"{'batch':>6} {'graphs ms':>10} {'eager ms':>9} {'eager/graphs':>13}")
    for batch in batches:
        times = {}
        for eager in (False, True):
            llm = decoding_engine(model_dir, shape, batch, prompt_len, num_steps, eager, device)
            times[eager] = step_ms(llm, num_steps)
            if batch == batches[-1] and eager and device.type == "cuda":
                num_layers = llm.engine.core.model.config.num_layers
                launched = kernels_per_step(llm)
                print(f"eager decode step at batch {batch}: {launched} kernels, ~{launched / num_layers:.1f} a layer")
            del llm
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"{batch:6d} {times[False]:10.2f} {times[True]:9.2f} {times[True] / times[False]:13.2f}", flush=True)


if __name__ == "__main__":
    main()
