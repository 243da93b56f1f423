"""Serving benchmark: N concurrent streaming clients against kvserve over HTTP, beside the engine's
offline throughput on the same workload, and (optionally) `transformers serve` as a peer server.

Each server runs as its own process on a loopback port; the clients run here with asyncio and
httpx. Reported per peer: request throughput, output tokens/s, TTFT and inter-token latency
(p50/p90/p99). The kvserve HTTP / offline ratio has a target of >= 0.9.

    .venv/bin/python -m benchmarks.serve_bench                      # kvserve over HTTP + offline
    .venv/bin/python -m benchmarks.serve_bench --peers kvserve,offline,transformers-serve
"""

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.checkpoints import qwen3_50m_dir
from benchmarks.servers import SERVED_MODEL_NAME, free_port, kvserve_serve_command, serving
from kvserve.engine import LLM, SamplingParams


@dataclass
class RequestResult:
    ttft_s: float
    itl_s: list[float]
    latency_s: float
    num_tokens: int


@dataclass
class PeerResult:
    name: str
    wall_s: float
    results: list[RequestResult] = field(default_factory=list)
    errors: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.results)


def make_workload(num_requests: int, seed: int) -> tuple[list[str], list[int]]:
    """Text prompts of pseudo-words (ASCII, so each streamed token shows at once) and output lengths."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "vo", "ze", "pa", "do", "gu"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(2000)]
    prompts = [" ".join(rng.choices(words, k=rng.randint(24, 200))) for _ in range(num_requests)]
    output_lens = [rng.randint(32, 256) for _ in range(num_requests)]
    return prompts, output_lens


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    start_s = time.perf_counter()
    token_times: list[float] = []
    num_tokens = 0
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in chunk.get("choices", [])):
                token_times.append(time.perf_counter())
    latency_s = time.perf_counter() - start_s
    itl = [b - a for a, b in itertools.pairwise(token_times)]
    return RequestResult(ttft_s=token_times[0] - start_s, itl_s=itl, latency_s=latency_s, num_tokens=num_tokens)


async def run_clients(name, base_url, model, prompts, output_lens, concurrency, extra) -> PeerResult:
    semaphore = asyncio.Semaphore(concurrency)
    result = PeerResult(name=name, wall_s=0.0)

    async def worker(prompt: str, max_tokens: int) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, **extra}  # fmt: skip
        async with semaphore:
            try:
                result.results.append(await one_request(client, f"{base_url}/v1/completions", body))
            except (httpx.HTTPError, KeyError, IndexError):
                result.errors += 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start_s = time.perf_counter()
        await asyncio.gather(*(worker(p, n) for p, n in zip(prompts, output_lens, strict=True)))
        result.wall_s = time.perf_counter() - start_s
    return result


def serve_kvserve(model_dir: Path, port: int, max_num_seqs: int) -> subprocess.Popen:
    command = kvserve_serve_command(model_dir, port, "--served-model-name", SERVED_MODEL_NAME, "--max-num-seqs",
                                    str(max_num_seqs), "--kv-cache-memory-bytes", str(2 << 30))  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def serve_transformers(model_dir: Path, port: int) -> subprocess.Popen:
    command = ["transformers", "serve", str(model_dir), "--port", str(port), "--host", "127.0.0.1",
               "--continuous-batching", "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_server_peer(name, start, model_name, prompts, output_lens, concurrency, extra) -> PeerResult:
    port = free_port()
    process = start(port)
    base_url = f"http://127.0.0.1:{port}"
    with serving(process, base_url):
        return asyncio.run(run_clients(name, base_url, model_name, prompts, output_lens, concurrency, extra))


def run_offline(model_dir: Path, prompts, output_lens, max_num_seqs: int) -> PeerResult:
    llm = LLM(str(model_dir), max_num_seqs=max_num_seqs, kv_cache_memory_bytes=2 << 30)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    start_s = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall_s = time.perf_counter() - start_s
    result = PeerResult(name="kvserve offline", wall_s=wall_s)
    result.results = [RequestResult(0.0, [], 0.0, len(o.token_ids)) for o in outputs]
    return result


def percentiles_ms(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    pick = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 for q in (0.5, 0.9, 0.99)]
    return "/".join(f"{v:.0f}" for v in pick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--peers", default="kvserve,offline")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of all peers, interleaved; medians reported")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    model_dir = qwen3_50m_dir()
    prompts, output_lens = make_workload(args.num_requests, seed=0)
    print(f"model {model_dir.name}; {args.num_requests} requests, {args.concurrency} concurrent clients, "
          f"outputs 32-256 tokens ({sum(output_lens)} in all), greedy, streamed; {args.repeat} rounds")  # fmt: skip
    peers = args.peers.split(",")
    rounds: list[dict[str, PeerResult]] = []
    for _ in range(args.repeat):
        results = {}
        if "kvserve" in peers:
            start = lambda port: serve_kvserve(model_dir, port, args.concurrency)  # noqa: E731
            results["kvserve over HTTP"] = run_server_peer(
                "kvserve over HTTP", start, SERVED_MODEL_NAME, prompts, output_lens, args.concurrency,
                {"ignore_eos": True},
            )  # fmt: skip
        if "offline" in peers:
            results["kvserve offline"] = run_offline(model_dir, prompts, output_lens, args.concurrency)
        if "transformers-serve" in peers:
            start = lambda port: serve_transformers(model_dir, port)  # noqa: E731
            try:
                results["transformers serve"] = run_server_peer(
                    "transformers serve", start, str(model_dir), prompts, output_lens, args.concurrency, {}
                )
            except RuntimeError as error:
                print(f"transformers serve: could not run ({error})")
        rounds.append(results)
        print("round:", ", ".join(f"{name} {r.num_tokens / r.wall_s:.1f} tok/s" for name, r in results.items()))

    print(f"\n{'peer':24} {'req/s':>6} {'out tok/s':>9} {'TTFT p50/90/99 ms':>18} {'ITL p50/90/99 ms':>17} {'err':>4}")
    for name in rounds[0]:
        runs = [r[name] for r in rounds if name in r]
        ttft = [x.ttft_s for run in runs for x in run.results if x.ttft_s]
        itl = [gap for run in runs for x in run.results for gap in x.itl_s]
        requests_per_s = statistics.median(len(run.results) / run.wall_s for run in runs)
        tokens_per_s = statistics.median(run.num_tokens / run.wall_s for run in runs)
        print(f"{name:24} {requests_per_s:6.2f} {tokens_per_s:9.1f} {percentiles_ms(ttft):>18} "
              f"{percentiles_ms(itl):>17} {sum(run.errors for run in runs):>4}")  # fmt: skip
    ratios = [
        (r["kvserve over HTTP"].num_tokens / r["kvserve over HTTP"].wall_s)
        / (r["kvserve offline"].num_tokens / r["kvserve offline"].wall_s)
        for r in rounds
        if "kvserve over HTTP" in r and "kvserve offline" in r
    ]
    if ratios:
        print(
            f"\nkvserve HTTP / offline output tokens/s per round: {', '.join(f'{x:.2f}' for x in ratios)}; "
            f"median {statistics.median(ratios):.2f} (target >= 0.9)"
        )


if __name__ == "__main__":
    main()
