"""Prefix caching and chunked prefill, each on vs off, in one process run.

A. Shared prefix: 64 requests share a 1,024-token prefix, each with a distinct 32-token suffix,
   all submitted at once: prefill tokens computed and mean time to first token.
B. Mixed: 32 requests decode; after their 10th token, 4 prompts of 1,500 tokens arrive: p50/p99
   inter-token latency of the 32 decoding requests while those prompts are prefilled.

    .venv/bin/python -m benchmarks.prefix_chunked_bench
"""

import argparse
import itertools
import random
import statistics
import time
from pathlib import Path

from benchmarks.checkpoints import QWEN3_50M_TOKENIZER_VOCAB, qwen3_50m_dir
from benchmarks.harness import random_tokens
from kvserve.engine import LLM, SamplingParams

KV_BYTES = 2 << 30


def tokens(rng: random.Random, n: int) -> list[int]:
    return random_tokens(rng, QWEN3_50M_TOKENIZER_VOCAB - 100, n)


def shared_prefix_run(model_dir: Path, enable_prefix_caching: bool) -> dict:
    rng = random.Random(0)
    prefix = tokens(rng, 1024)
    prompts = [prefix + tokens(rng, 32) for _ in range(64)]
    engine = LLM(str(model_dir), kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=enable_prefix_caching).engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    start_s = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    requests = [engine.core.scheduler.get(request_id) for request_id in ids]
    first_token_s: dict[str, float] = {}
    while engine.has_unfinished():
        engine.step()
        for request in requests:
            if request.output_token_ids:
                first_token_s.setdefault(request.request_id, time.perf_counter() - start_s)
    scheduler = engine.core.scheduler
    return {
        "prompt_tokens": sum(len(p) for p in prompts),
        "computed_prompt_tokens": sum(len(p) for p in prompts) - scheduler.prefix_cache_hit_tokens,
        "mean_ttft_s": statistics.mean(first_token_s[i] for i in ids),
        "wall_s": time.perf_counter() - start_s,
    }


def mixed_run(model_dir: Path, enable_chunked_prefill: bool, budget: int) -> dict:
    rng = random.Random(1)
    engine = LLM(
        str(model_dir), kv_cache_memory_bytes=KV_BYTES, enable_chunked_prefill=enable_chunked_prefill,
        max_num_batched_tokens=budget, enable_prefix_caching=False,
    ).engine  # fmt: skip
    decode_params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    decoders = [engine.core.scheduler.get(engine.add_request(tokens(rng, 32), decode_params)) for _ in range(32)]
    token_times: dict[str, list[float]] = {request.request_id: [] for request in decoders}
    long_added = False
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter()
        for request in decoders:  # the times each request's number of tokens grew
            if len(request.output_token_ids) > len(token_times[request.request_id]):
                token_times[request.request_id].append(now)
        if not long_added and min(len(t) for t in token_times.values()) >= 10:
            for _ in range(4):
                engine.add_request(tokens(rng, 1500), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            long_added = True
    gaps = sorted(b - a for times in token_times.values() for a, b in itertools.pairwise(times))
    return {
        "p50_itl_ms": 1e3 * gaps[len(gaps) // 2],
        "p99_itl_ms": 1e3 * gaps[int(0.99 * len(gaps))],
        "max_itl_ms": 1e3 * gaps[-1],
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options but --help
    model_dir = qwen3_50m_dir()
    print(f"model {model_dir.name}")
    print("\nA. 64 requests, shared 1,024-token prefix + 32-token suffixes, all at once")
    off = shared_prefix_run(model_dir, enable_prefix_caching=False)
    on = shared_prefix_run(model_dir, enable_prefix_caching=True)
    for name, result in (("prefix caching off", off), ("prefix caching on", on)):
        computed, total = result["computed_prompt_tokens"], result["prompt_tokens"]
        print(f"  {name:20} prompt tokens computed {computed:6d} of {total}, "
              f"mean TTFT {result['mean_ttft_s']:6.2f} s, wall {result['wall_s']:6.2f} s")  # fmt: skip
    print(f"  TTFT improvement: {off['mean_ttft_s'] / on['mean_ttft_s']:.1f}x (target >= 5x)")

    print("\nB. 32 decoding requests; 4 prompts of 1,500 tokens arrive after their 10th token")
    for name, chunked, budget in (("chunked prefill off, budget 2048", False, 2048),
                                  ("chunked prefill on, budget 2048", True, 2048),
                                  ("chunked prefill on, budget 256", True, 256)):  # fmt: skip
        result = mixed_run(model_dir, chunked, budget)
        print(f"  {name:34} ITL p50 {result['p50_itl_ms']:7.1f} ms, p99 {result['p99_itl_ms']:7.1f} ms, "
              f"max {result['max_itl_ms']:7.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
