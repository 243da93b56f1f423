"""What each CPU speed-up is worth: the offline workload of benchmarks/vs_vllm.py with one of them off.

Variants, each run in its own process, in alternating rounds:
- all: kvserve as it ships;
- no-malloc-settings: glibc's default mmap/trim thresholds (engine/cpu_memory.py not applied);
- unpacked-weights: float32 linear layers through `F.linear` (MKL's sgemm), no oneDNN packed weights;
- torch-backend: the torch attention path and torch layer ops instead of the C++ kernels.

    .venv/bin/python -m benchmarks.cpu_ablation [--rounds 3] [--variants all,unpacked-weights]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from transformers import AutoConfig

from benchmarks.checkpoints import llama_45m_dir
from benchmarks.harness import random_requests
from benchmarks.processes import child_cwd

VARIANTS = ("all", "no-malloc-settings", "unpacked-weights", "torch-backend")


def run_variant(variant: str, model_dir: str, workload: list[dict]) -> float:
    """Output tokens/s of one generate call over the workload, with `variant`'s speed-up off."""
    from kvserve.engine import LLM, SamplingParams, core
    from kvserve.kernels.cpu_backend import CpuBackend

    settings = {"max_num_seqs": len(workload), "kv_cache_memory_bytes": 2 << 30}
    if variant == "no-malloc-settings":
        core.keep_freed_memory_resident = lambda: False
    elif variant == "unpacked-weights":
        CpuBackend.prepare_linear = CpuBackend.prepare_experts = lambda *args: None
    elif variant == "torch-backend":
        settings["attention_backend"] = "torch"
    llm = LLM(model_dir, **settings)
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in workload]
    start_s = time.perf_counter()
    outputs = llm.generate([r["prompt_token_ids"] for r in workload], params)
    return sum(len(output.token_ids) for output in outputs) / (time.perf_counter() - start_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # variant, model dir, workload file
    args = parser.parse_args()
    if args.worker:
        variant, model_dir, workload_file = args.worker
        print(run_variant(variant, model_dir, json.loads(Path(workload_file).read_text())))
        return
    model_dir = llama_45m_dir()
    workload_file = Path(f"/tmp/cpu-ablation-{time.time_ns()}.json")
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    workload_file.write_text(json.dumps(random_requests(64, vocab_size, (32, 512), (16, 256), seed=0)))
    variants = args.variants.split(",")
    results: dict[str, list[float]] = {variant: [] for variant in variants}
    for index in range(args.rounds):
        for variant in variants if index % 2 == 0 else variants[::-1]:
            command = [sys.executable, "-m", __spec__.name, "--worker", variant, str(model_dir), str(workload_file)]
            output = subprocess.run(command, capture_output=True, text=True, check=True, cwd=child_cwd()).stdout
            results[variant].append(float(output.strip().splitlines()[-1]))
        print(f"round {index + 1}: " + ", ".join(f"{v} {r[-1]:.0f}" for v, r in results.items()), flush=True)
    workload_file.unlink()
    baseline = statistics.median(results[variants[0]])
    print(f"\n{'variant':20} {'tok/s (median)':>15} {'vs ' + variants[0]:>10}")
    for variant, rates in results.items():
        print(f"{variant:20} {statistics.median(rates):15.0f} {statistics.median(rates) / baseline:10.3f}")


if __name__ == "__main__":
    main()
