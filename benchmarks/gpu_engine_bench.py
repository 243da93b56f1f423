"""End-to-end offline throughput on a GPU: kvserve (Triton kernels) vs HF continuous batching.

A Qwen3-0.6B-shaped model with seeded random weights (no download) serves 128 requests with prompt
and output lengths uniform in 100-1024 (greedy, EOS ignored, each request its own output length).
The peers run in this process on the same checkpoint, one after the other: kvserve, kvserve with
an int8 KV cache, HF. Each warms up first (kvserve compiles its kernels and captures its decode graphs
at start-up; HF captures its CUDA graphs) and is timed from the first request to the last token.

    python -m benchmarks.gpu_engine_bench            # the workload of BENCHMARKS.md (CUDA)
    python -m benchmarks.gpu_engine_bench --smoke    # a tiny model and workload, to check the script on a CPU
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.checkpoints import QWEN3_0_6B_SHAPE, SMOKE_SHAPE, kv_bytes_per_token, qwen3_shaped_dir
from benchmarks.harness import random_workload
from benchmarks.offline_runs import run_hf_continuous
from kvserve.engine import LLM, SamplingParams


def run_kvserve(model_dir: Path, prompts, output_lens, dtype: str, kv_cache_dtype: str, kv_bytes: int):
    llm = LLM(
        str(model_dir), dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_num_seqs=len(prompts),
        kv_cache_memory_bytes=kv_bytes,
    )  # fmt: skip
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    engine = llm.engine
    synchronize()
    start_s = time.perf_counter()
    for prompt, sampling in zip(prompts, params, strict=True):
        engine.add_request(prompt, sampling)
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += sum(len(delta.token_ids) for delta in engine.step())
    synchronize()
    elapsed_s = time.perf_counter() - start_s
    print(f"kvserve: backend {engine.core.runner.worker.backend.name}, {engine.core.kv_cache.num_blocks} KV blocks")
    del llm, engine
    return elapsed_s, num_tokens


def run_hf(model_dir: Path, prompts, output_lens, dtype: torch.dtype, device) -> tuple[float, int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    return run_hf_continuous(model, prompts, output_lens, warmup=device.type == "cuda")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload on whatever device there is")
    parser.add_argument("--num-requests", type=int, default=128)
    # kvserve's two runs first: HF takes the longest, and a check cut off by its time limit still has them.
    parser.add_argument("--peers", default="kvserve,kvserve-int8,hf-continuous", help="run in this order")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SMOKE_SHAPE if args.smoke else QWEN3_0_6B_SHAPE
    num_requests, lengths = (6, (10, 40)) if args.smoke else (args.num_requests, (100, 1024))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    start_s = time.perf_counter()
    model_dir = qwen3_shaped_dir(shape)
    print(f"{model_dir} ready in {time.perf_counter() - start_s:.0f} s; device {device}, {dtype}")
    prompts, output_lens = random_workload(num_requests, shape["vocab_size"], lengths, lengths, seed=0)
    print(f"{num_requests} requests, prompt and output lengths uniform in {lengths}: {sum(output_lens)} tokens out")
    # A byte budget, not a share of the GPU: the peers run one after another in this process, and a share would
    # count what the one before left allocated. This one holds every request whole at once (16-token blocks).
    kv_bytes = sum(len(p) + n + 16 for p, n in zip(prompts, output_lens, strict=True)) * kv_bytes_per_token(
        shape, dtype.itemsize
    )
    results = {}
    for peer in args.peers.split(","):
        if peer.startswith("kvserve"):
            kv_cache_dtype = "int8" if peer == "kvserve-int8" else "auto"
            dtype_name = str(dtype).removeprefix("torch.")
            results[peer] = run_kvserve(model_dir, prompts, output_lens, dtype_name, kv_cache_dtype, kv_bytes)
        else:
            results[peer] = run_hf(model_dir, prompts, output_lens, dtype, device)
        print(f"{peer}: {results[peer][1] / results[peer][0]:.0f} tok/s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    kvserve_rate = results["kvserve"][1] / results["kvserve"][0] if "kvserve" in results else None
    print(f"\n{'peer':16} {'time s':>8} {'out tok':>8} {'tok/s':>8} {'kvserve x':>10}")
    for name, (elapsed_s, num_tokens) in results.items():
        rate = num_tokens / elapsed_s
        ratio = f"{kvserve_rate / rate:.2f}" if kvserve_rate else "-"
        print(f"{name:16} {elapsed_s:8.1f} {num_tokens:8d} {rate:8.0f} {ratio:>10}")
        if num_tokens != sum(output_lens):
            print(f"  warning: {name} produced {num_tokens} tokens, expected {sum(output_lens)}")


if __name__ == "__main__":
    main()
