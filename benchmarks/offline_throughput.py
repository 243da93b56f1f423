"""Offline throughput: kvserve vs HF `generate` (static padded batches) vs HF continuous batching.

One process runs every peer on the same checkpoint and workload, one after the other, and prints
output tokens/s and the ratios; then kvserve's KV slot utilisation over the run and the time the
scheduler and allocator take per step with 256 running sequences (no model).

    python benchmarks/offline_throughput.py            # the workload of BENCHMARKS.md
    python benchmarks/offline_throughput.py --quick    # a small smoke run
"""

import argparse
import random
import statistics
import string
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config
from transformers.generation.continuous_batching.utils import WorkloadHints

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.default_model import cache_root
from kvserve.kvcache import BlockAllocator
from kvserve.scheduler import FinishReason, Request, Scheduler, SchedulerConfig
from kvserve.testing.tiny_checkpoint import train_tokenizer, write_random_checkpoint

MODEL_NAME = "bench-qwen3-50m-v1"
VOCAB_SIZE = 32000


def benchmark_model_dir() -> Path:
    """A Qwen3-shaped ~50M-parameter checkpoint with random weights and a 32k BPE vocabulary."""
    model_dir = cache_root() / MODEL_NAME
    if (model_dir / "config.json").exists():
        return model_dir
    tokenizer = train_tokenizer(synthetic_corpus(), VOCAB_SIZE)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
    )
    return write_random_checkpoint(config, tokenizer, model_dir, seed=0)


def synthetic_corpus() -> str:
    """Enough distinct pseudo-words for a 32k-token BPE vocabulary."""
    rng = random.Random(0)
    syllables = [c + v for c in string.ascii_lowercase for v in "aeiouy"] + list(string.ascii_lowercase)
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 5))) for _ in range(60000)]
    lines = [" ".join(rng.choices(words, k=16)) for _ in range(30000)]
    return "\n".join(lines)


def make_workload(num_requests: int, vocab_size: int, prompt_range, output_range, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab_size) for _ in range(rng.randint(*prompt_range))] for _ in range(num_requests)]
    output_lens = [rng.randint(*output_range) for _ in range(num_requests)]
    return prompts, output_lens


def run_kvserve(model_dir: Path, prompts, output_lens, max_num_seqs: int):
    llm = LLM(str(model_dir), max_num_seqs=max_num_seqs, kv_cache_memory_bytes=2 << 30)
    engine = llm.engine
    for prompt, output_len in zip(prompts, output_lens, strict=True):
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    utilizations = []
    num_tokens = 0
    start_s = time.perf_counter()
    while engine.has_unfinished():
        num_tokens += sum(len(delta.token_ids) for delta in engine.step())
        usage = engine.kv_usage()
        if usage.num_used_blocks:
            utilizations.append(usage.slot_utilization)
    elapsed_s = time.perf_counter() - start_s
    return elapsed_s, num_tokens, utilizations


def run_hf_static(model, prompts, output_lens, batch_size: int, pad_token_id: int):
    """`generate` on batches in arrival order, left-padded; each batch decodes to its longest output."""
    num_tokens = 0
    start_s = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch, lens = prompts[first : first + batch_size], output_lens[first : first + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max(lens),
            do_sample=False,
            pad_token_id=pad_token_id,
        )
        assert out.shape[1] == width + max(lens)
        num_tokens += sum(lens)  # only the tokens each request asked for count
    return time.perf_counter() - start_s, num_tokens


def run_hf_continuous(model, prompts, output_lens, warmup: bool = False):
    """HF continuous batching (the manager behind `generate_batch`), with each request's own length.
    `warmup` captures its CUDA graphs before the clock starts."""
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(output_lens))
    hints = WorkloadHints(
        max_prompt_length=max(map(len, prompts)), max_generated_length=max(output_lens), num_requests=len(prompts)
    )
    num_tokens = 0
    with model.continuous_batching_context_manager(
        generation_config=config, warmup=warmup, workload_hints=hints
    ) as manager:
        start_s = time.perf_counter()
        for prompt, output_len in zip(prompts, output_lens, strict=True):
            manager.add_request(prompt, max_new_tokens=output_len, eos_token_id=-1)
        for _ in prompts:
            result = manager.get_result(timeout=600)
            while result is not None and not result.is_finished():
                result = manager.get_result(timeout=600)
            num_tokens += len(result.generated_tokens)
        elapsed_s = time.perf_counter() - start_s
    return elapsed_s, num_tokens


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

    model_dir = benchmark_model_dir()
    prompt_range, output_range = ((8, 64), (4, 32)) if args.quick else ((32, 512), (16, 512))
    num_requests = 8 if args.quick else args.num_requests
    vocab_size = Qwen3Config.from_pretrained(model_dir).vocab_size
    prompts, output_lens = make_workload(num_requests, vocab_size, prompt_range, output_range, seed=0)
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
