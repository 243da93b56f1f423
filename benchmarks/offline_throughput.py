"""Offline throughput: kvserve vs HF `generate` (static padded batches) vs HF continuous batching.

One process runs every peer on the same checkpoint and workload, one after the other, and prints
output tokens/s and the ratios; then kvserve's KV slot utilisation over the run and the time the
scheduler and allocator take per step with 256 running sequences (no model).

    .venv/bin/python -m benchmarks.offline_throughput            # the workload of BENCHMARKS.md
    .venv/bin/python -m benchmarks.offline_throughput --quick    # a small smoke run
"""

import argparse
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from benchmarks.checkpoints import qwen3_50m_dir
from benchmarks.harness import random_workload
from benchmarks.offline_runs import run_hf_continuous, run_hf_static, run_kvserve
from kvserve.kvcache import BlockAllocator
from kvserve.scheduler import FinishReason, Request, Scheduler, SchedulerConfig


def scheduler_step_us(num_running: int, num_steps: int, prefix_caching: bool, block_size: int = 16) -> list[float]:
    """Per-step time of schedule() + update() with `num_running` decoding sequences (no model)."""
    config = SchedulerConfig(
        max_num_seqs=num_running, max_num_batched_tokens=1 << 20, enable_chunked_prefill=True,
        enable_prefix_caching=prefix_caching,
    )  # fmt: skip
    scheduler = Scheduler(config, BlockAllocator(num_running * 64), block_size)
    rng = random.Random(0)
    for i in range(num_running):
        scheduler.add(Request(request_id=str(i), prompt_token_ids=[1] * rng.randint(32, 512)))
    output = scheduler.schedule()  # admits and prefills all
    scheduler.update(output, [7] * len(output.scheduled))
    timings = []
    for _ in range(num_steps):
        start_s = time.perf_counter()
        output = scheduler.schedule()
        scheduler.update(output, [7] * len(output.scheduled))
        timings.append((time.perf_counter() - start_s) * 1e6)
    for request in list(scheduler.running):
        scheduler.finish(request, FinishReason.LENGTH)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 short requests, for a smoke run")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--hf-batch-sizes", default="16,64", help="static batch sizes to try for HF generate")
    parser.add_argument("--peers", default="kvserve,hf-static,hf-continuous")
    parser.add_argument("--repeat", type=int, default=1, help="runs per peer; the median time is reported")
    args = parser.parse_args()
    torch.manual_seed(0)

    model_dir = qwen3_50m_dir()
    prompt_range, output_range = ((8, 64), (4, 32)) if args.quick else ((32, 512), (16, 512))
    num_requests = 8 if args.quick else args.num_requests
    vocab_size = Qwen3Config.from_pretrained(model_dir).vocab_size
    prompts, output_lens = random_workload(num_requests, vocab_size, prompt_range, output_range, seed=0)
    expected_tokens = sum(output_lens)
    print(
        f"model {model_dir.name}; {num_requests} requests, prompts {prompt_range}, outputs {output_range}, "
        f"{expected_tokens} output tokens; torch threads {torch.get_num_threads()}; {args.repeat} run(s) per peer"
    )

    runs: dict[str, list] = {}
    peers = args.peers.split(",")
    for _ in range(args.repeat):
        if "kvserve" in peers:
            elapsed_s, num_tokens, utilizations = run_kvserve(model_dir, prompts, output_lens, num_requests)
            runs.setdefault("kvserve", []).append((elapsed_s, num_tokens))
            print(
                f"kvserve KV slot utilisation over {len(utilizations)} steps: "
                f"mean {statistics.mean(utilizations):.4f}, min {min(utilizations):.4f}"
            )
        hf_model = None
        if "hf-static" in peers or "hf-continuous" in peers:
            hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
            hf_model.generation_config.eos_token_id = None
        if "hf-static" in peers:
            for batch_size in map(int, args.hf_batch_sizes.split(",")):
                result = run_hf_static(hf_model, prompts, output_lens, batch_size, pad_token_id=0)
                runs.setdefault(f"hf-generate-static-b{batch_size}", []).append(result)
        if "hf-continuous" in peers:
            runs.setdefault("hf-continuous-batching", []).append(run_hf_continuous(hf_model, prompts, output_lens))

    results = {name: (statistics.median(t for t, _ in peer_runs), peer_runs[0][1]) for name, peer_runs in runs.items()}
    print(f"\n{'peer':32} {'time s':>8} {'out tok':>8} {'tok/s':>8} {'kvserve x':>10}")
    kvserve_rate = results["kvserve"][1] / results["kvserve"][0] if "kvserve" in results else None
    for name, (elapsed_s, num_tokens) in results.items():
        rate = num_tokens / elapsed_s
        ratio = f"{kvserve_rate / rate:.2f}" if kvserve_rate else "-"
        print(f"{name:32} {elapsed_s:8.1f} {num_tokens:8d} {rate:8.1f} {ratio:>10}")
        if num_tokens != expected_tokens:
            print(f"  warning: {name} produced {num_tokens} tokens, expected {expected_tokens}")

    for prefix_caching in (False, True):
        timings = scheduler_step_us(num_running=256, num_steps=200, prefix_caching=prefix_caching)
        print(
            f"\nscheduler + allocator per step, 256 running, prefix caching {'on' if prefix_caching else 'off'}: "
            f"median {statistics.median(timings):.0f} us, p90 {sorted(timings)[int(0.9 * len(timings))]:.0f} us"
        )


if __name__ == "__main__":
    main()
