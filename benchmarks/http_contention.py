"""Does the engine thread lose time to the HTTP side beyond the CPU the HTTP side uses?

kvserve runs its engine loop on a thread of the server process, beside the asyncio thread that
parses requests, streams SSE and runs the handlers; both share one GIL. This runs one workload
(96 requests of 128-384 prompt tokens, 64-192 output tokens, greedy, 32 at a time) twice:

- offline: `LLM.generate` in this process, with `max_num_seqs` 32;
- served: `kvserve serve` in its own process, fed by a streaming client process (httpx, 32
  concurrent requests, the same prompts as token ids), while /proc gives the CPU seconds of the
  server's HTTP thread, of its engine thread (with the torch threads it starts) and of the client.

If served tok/s is below offline tok/s by about the share of the machine's CPU that the HTTP thread
and the client took, the engine lost only CPU, which a separate engine process would not give back
(it would still share the cores); a larger loss is GIL waiting, which a separate process would remove.

    python benchmarks/http_contention.py [--rounds 3]
"""

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONCURRENCY = 32


def workload(vocab_size: int, num_requests: int = 96, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(4, vocab_size) for _ in range(rng.randint(128, 384))], rng.randint(64, 192))
        for _ in range(num_requests)
    ]


def run_offline(model_dir: Path, requests) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), max_num_seqs=CONCURRENCY, kv_cache_memory_bytes=2 << 30)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    start_s = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in requests], params)
    return sum(len(output.token_ids) for output in outputs) / (time.perf_counter() - start_s)


async def _client(url: str, requests) -> int:
    import httpx

    semaphore = asyncio.Semaphore(CONCURRENCY)
    counts = []

    async def one(client, prompt, max_tokens) -> None:
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        async with semaphore, client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"usage": {' in line:
                    counts.append(json.loads(line[6:])["usage"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(one(client, prompt, n) for prompt, n in requests))
    return sum(counts)


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of a process, by thread name (summed over threads of one name)."""
    per_name: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick
        key = "http" if task.name == str(pid) else name
        per_name[key] = per_name.get(key, 0.0) + seconds
    return per_name


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_served(model_dir: Path, requests_file: Path) -> dict:
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    server = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", str(model_dir), "--port", str(port), "--served-model-name",
         "bench", "--max-num-seqs", str(CONCURRENCY), "--kv-cache-memory-bytes", str(2 << 30)],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        before = _thread_cpu_s(server.pid)
        start_s = time.perf_counter()
        client = subprocess.Popen(
            [sys.executable, __file__, "--client", url, str(requests_file)], env=env, stdout=subprocess.PIPE
        )
        client_cpu_s = 0.0
        while client.poll() is None:  # the client's own CPU time, read while it lives
            client_cpu_s = _process_cpu_s(client.pid)
            time.sleep(0.05)
        num_tokens = int(client.stdout.read())
        wall_s = time.perf_counter() - start_s
        after = _thread_cpu_s(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)
    used = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    http_s = used.pop("http")
    return {"tok_s": num_tokens / wall_s, "wall_s": wall_s, "http_cpu_s": http_s, "client_cpu_s": client_cpu_s,
            "engine_cpu_s": sum(used.values())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        url, requests_file = args.client
        print(asyncio.run(_client(url, json.loads(Path(requests_file).read_text()))))
        return
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(Path(__file__).parent))
    from transformers import AutoConfig
    from vs_vllm import bench_model_dir

    model_dir = bench_model_dir()
    requests = workload(AutoConfig.from_pretrained(model_dir).vocab_size)
    requests_file = Path(f"/tmp/http-contention-{os.getpid()}.json")
    requests_file.write_text(json.dumps(requests))
    cores = os.cpu_count()
    print(f"{model_dir.name}; {len(requests)} requests, {CONCURRENCY} at a time; {cores} cores")
    ratios, shares = [], []
    for index in range(args.rounds):
        offline = run_offline(model_dir, requests)
        served = run_served(model_dir, requests_file)
        share = (served["http_cpu_s"] + served["client_cpu_s"]) / (cores * served["wall_s"])
        ratios.append(served["tok_s"] / offline)
        shares.append(share)
        print(f"round {index + 1}: offline {offline:.0f} tok/s; served {served['tok_s']:.0f} tok/s "
              f"({ratios[-1]:.3f} of offline) in {served['wall_s']:.1f} s; CPU s: HTTP thread "
              f"{served['http_cpu_s']:.2f}, client {served['client_cpu_s']:.2f}, engine threads "
              f"{served['engine_cpu_s']:.2f}; HTTP thread + client = {share:.3f} of the machine",
              flush=True)  # fmt: skip
    requests_file.unlink()
    print(f"\nmedian served / offline: {statistics.median(ratios):.3f}; median share of the machine's CPU taken by "
          f"the HTTP thread and the client: {statistics.median(shares):.3f}; unexplained loss: "
          f"{1 - statistics.median(ratios) - statistics.median(shares):+.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
