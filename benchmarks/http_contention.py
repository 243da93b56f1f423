"""Does the engine thread lose time to the HTTP side beyond the CPU the HTTP side uses?

kvserve runs its engine loop on a thread of the server process, beside the asyncio thread that
parses requests, streams SSE and runs the handlers; both share one GIL. This runs one workload
(96 requests of 128-384 prompt tokens, 64-192 output tokens, greedy, 32 at a time) twice:

- offline: `LLM.generate` in this process, with `max_num_seqs` 32;
- served: `kvserve serve` in its own process, fed by a streaming client process (httpx, 32
  concurrent requests, the same prompts as token ids), while /proc gives the CPU seconds of the
  server's HTTP thread, of its engine thread (with the torch threads it starts) and of the client.

- offline beside a competitor: `LLM.generate` again while another process burns, in 2 ms bursts, as
  much CPU as the HTTP thread and the client took in the served run, but holds no GIL of ours.

If served tok/s matches the offline run beside the competitor, the engine lost only CPU (a separate
engine process would still share the cores with the HTTP side and the client); served below it is
what the shared GIL costs, which a separate engine process would give back.

    .venv/bin/python -m benchmarks.http_contention [--rounds 3]

The streaming client and the competitor run this module in processes of their own: it imports only the standard
library at the top, and each side imports what it uses where it uses it, so the client's CPU time is the client's.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.processes import child_cwd, child_env, process_cpu_s

CONCURRENCY = 32


def run_offline(model_dir: Path, requests: list[dict]) -> float:
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), max_num_seqs=CONCURRENCY, kv_cache_memory_bytes=2 << 30)
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in requests]
    start_s = time.perf_counter()
    outputs = llm.generate([r["prompt_token_ids"] for r in requests], params)
    return sum(len(output.token_ids) for output in outputs) / (time.perf_counter() - start_s)


async def _client(url: str, requests: list[dict]) -> int:
    import httpx

    from benchmarks.servers import SERVED_MODEL_NAME

    semaphore = asyncio.Semaphore(CONCURRENCY)
    counts = []

    async def one(client, prompt, max_tokens) -> None:
        body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        async with semaphore, client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"usage":' in line:
                    counts.append(json.loads(line[6:])["usage"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(one(client, r["prompt_token_ids"], r["max_tokens"]) for r in requests))
    return sum(counts)


def _burn(share_of_one_core: float, seconds: float, burst_s: float = 0.002) -> None:
    """Busy-loop `share_of_one_core` of one core, in bursts, for `seconds`."""
    end_s = time.monotonic() + seconds
    while time.monotonic() < end_s:
        start_s = time.perf_counter()
        while time.perf_counter() - start_s < burst_s:
            pass
        time.sleep(burst_s * (1 / share_of_one_core - 1))


def run_offline_beside(model_dir: Path, requests, share_of_one_core: float) -> float:
    command = [sys.executable, "-m", __spec__.name, "--burn", str(share_of_one_core)]
    competitor = subprocess.Popen(command, cwd=child_cwd())
    try:
        return run_offline(model_dir, requests)
    finally:
        competitor.kill()
        competitor.wait()


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


def run_served(model_dir: Path, requests_file: Path) -> dict:
    from benchmarks.servers import SERVED_MODEL_NAME, free_port, kvserve_serve_command, serving

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = child_env()
    server = subprocess.Popen(
        kvserve_serve_command(model_dir, port, "--served-model-name", SERVED_MODEL_NAME, "--max-num-seqs",
                              str(CONCURRENCY), "--kv-cache-memory-bytes", str(2 << 30)),
        env=env, cwd=child_cwd(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    with serving(server, url):
        before = _thread_cpu_s(server.pid)
        start_s = time.perf_counter()
        client = subprocess.Popen(
            [sys.executable, "-m", __spec__.name, "--client", url, str(requests_file)], env=env, cwd=child_cwd(),
            stdout=subprocess.PIPE,
        )  # fmt: skip
        client_cpu_s = 0.0
        while client.poll() is None:  # the client's own CPU time, read while it lives
            client_cpu_s = process_cpu_s(client.pid)
            time.sleep(0.05)
        num_tokens = int(client.stdout.read())
        wall_s = time.perf_counter() - start_s
        after = _thread_cpu_s(server.pid)
    used = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    http_s = used.pop("http")
    return {"tok_s": num_tokens / wall_s, "wall_s": wall_s, "http_cpu_s": http_s, "client_cpu_s": client_cpu_s,
            "engine_cpu_s": sum(used.values())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--burn", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.burn:
        _burn(args.burn, seconds=600)
        return
    if args.client:
        url, requests_file = args.client
        print(asyncio.run(_client(url, json.loads(Path(requests_file).read_text()))))
        return
    from transformers import AutoConfig

    from benchmarks.checkpoints import llama_45m_dir
    from benchmarks.harness import random_requests

    model_dir = llama_45m_dir()
    requests = random_requests(96, AutoConfig.from_pretrained(model_dir).vocab_size, (128, 384), (64, 192), seed=0)
    requests_file = Path(f"/tmp/http-contention-{os.getpid()}.json")
    requests_file.write_text(json.dumps(requests))
    cores = os.cpu_count()
    print(f"{model_dir.name}; {len(requests)} requests, {CONCURRENCY} at a time; {cores} cores")
    rows = []
    for index in range(args.rounds):
        offline = run_offline(model_dir, requests)
        served = run_served(model_dir, requests_file)
        other_cpu_s = served["http_cpu_s"] + served["client_cpu_s"]
        beside = run_offline_beside(model_dir, requests, other_cpu_s / served["wall_s"])
        rows.append((offline, served["tok_s"], beside, other_cpu_s / (cores * served["wall_s"])))
        print(f"round {index + 1}: offline {offline:.0f} tok/s; served {served['tok_s']:.0f} tok/s in "
              f"{served['wall_s']:.1f} s (CPU s: HTTP thread {served['http_cpu_s']:.2f}, client "
              f"{served['client_cpu_s']:.2f}, engine threads {served['engine_cpu_s']:.2f}: the HTTP thread and "
              f"the client took {rows[-1][3]:.3f} of the machine); offline beside a competitor taking as much: "
              f"{beside:.0f} tok/s", flush=True)  # fmt: skip
    requests_file.unlink()
    offline, served, beside, share = (statistics.median(column) for column in zip(*rows, strict=True))
    print(f"\nmedians: served / offline {served / offline:.3f}; offline beside the competitor / offline "
          f"{beside / offline:.3f}; served / offline beside the competitor {served / beside:.3f} "
          f"(the HTTP thread and the client took {share:.3f} of the machine)")  # fmt: skip


if __name__ == "__main__":
    main()
