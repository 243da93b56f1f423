"""Soak: constant mixed load against a `kvserve serve` process for a bounded time, then a report.

Clients loop until the deadline, each request drawn at random: completions and chat, streamed or not, n=2
sampling, a client that leaves mid-stream, and a bad request (which must get its 400). Reported: requests
served by kind, unexpected answers (errors), and the server's RSS and free KV blocks before the load, after a
warm-up, and at the end (after the load, once idle), with RSS sampled during the load and its slope over the
load's second half (a leak keeps rising there; allocator caches have settled); then the server is stopped with
SIGTERM.

    .venv/bin/python -m benchmarks.soak                         # 10 minutes, the built-in default model
    .venv/bin/python -m benchmarks.soak --duration-s 60 --model /path/to/checkpoint --json soak.json

Exit status 1 if any answer was unexpected or a KV block stayed held.
"""

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.servers import free_port, kvserve_serve_command, wait_healthy

MODEL_NAME = "soak"
KINDS = ("completion", "completion-stream", "chat", "chat-stream", "sampled-n2", "leave-mid-stream", "bad-request")
IDLE_TIMEOUT_S = 60
STOP_TIMEOUT_S = 60


@dataclass
class Snapshot:
    """The server process at one moment."""

    at_s: float
    rss_mib: float
    free_blocks: int
    total_blocks: int


@dataclass
class SoakReport:
    duration_s: float
    concurrency: int
    served: dict[str, int] = field(default_factory=dict)  # plain dicts: asdict() would mangle a Counter
    unexpected: dict[str, int] = field(default_factory=dict)
    snapshots: dict[str, Snapshot] = field(default_factory=dict)
    rss_samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB) under load
    exit_status: int | None = None


def count(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024


def gauge(metrics_text: str, name: str) -> int:
    return int(float(re.search(rf"^kvserve:{name}\{{[^}}]*\}} (\S+)$", metrics_text, re.MULTILINE)[1]))


def snapshot(base_url: str, pid: int, start_s: float) -> Snapshot:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    total = gauge(text, "kv_cache_blocks")
    return Snapshot(time.monotonic() - start_s, rss_mib(pid), total - gauge(text, "kv_cache_used_blocks"), total)


def request_for(kind: str, rng: random.Random) -> tuple[str, dict]:
    words = " ".join(rng.choices(["cache", "block", "token", "river", "town", "step"], k=rng.randint(3, 60)))
    max_tokens = rng.randint(8, 96)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens}
    completion = {"model": MODEL_NAME, "prompt": words, "max_tokens": max_tokens}
    return {
        "completion": ("/v1/completions", completion),
        "completion-stream": ("/v1/completions", {**completion, "stream": True}),
        "chat": ("/v1/chat/completions", chat),
        "chat-stream": ("/v1/chat/completions", {**chat, "stream": True}),
        "sampled-n2": ("/v1/completions", {**completion, "n": 2, "temperature": 0.8, "seed": rng.randint(0, 99)}),
        "leave-mid-stream": ("/v1/completions", {**completion, "max_tokens": 200, "ignore_eos": True, "stream": True}),
        "bad-request": ("/v1/completions", {**completion, "temperature": -1}),
    }[kind]


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random) -> bool:
    """True if the answer was the expected one."""
    path, body = request_for(kind, rng)
    async with client.stream("POST", path, json=body) as response:
        if kind == "bad-request":
            await response.aread()
            return response.status_code == 400
        if response.status_code != 200:
            return False
        if kind == "leave-mid-stream":
            events, leave_after = 0, rng.randint(1, 30)
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events >= leave_after:
                    return True
            return True
        text = (await response.aread()).decode()
        return '"error"' not in text and (not body.get("stream") or text.rstrip().endswith("data: [DONE]"))


def slope_mib_per_hour(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of RSS over time."""
    mean_t = sum(t for t, _ in samples) / len(samples)
    mean_rss = sum(rss for _, rss in samples) / len(samples)
    spread = sum((t - mean_t) ** 2 for t, _ in samples)
    return 3600 * sum((t - mean_t) * (rss - mean_rss) for t, rss in samples) / spread


async def sample_rss(pid: int, report: SoakReport, start_s: float, deadline_s: float, every_s: float) -> None:
    while (now_s := time.monotonic()) < deadline_s:
        report.rss_samples.append((round(now_s - start_s, 1), rss_mib(pid)))
        await asyncio.sleep(min(every_s, deadline_s - now_s))


async def load(base_url: str, report: SoakReport, deadline_s: float, seed: int) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def worker(worker_seed: int) -> None:
            rng = random.Random(worker_seed)
            while time.monotonic() < deadline_s:
                kind = rng.choice(KINDS)
                try:
                    expected = await one_request(client, kind, rng)
                except httpx.HTTPError as error:
                    count(report.unexpected, f"{kind}: {type(error).__name__}")
                    continue
                count(report.served if expected else report.unexpected, kind)

        await asyncio.gather(*(worker(seed * 1000 + i) for i in range(report.concurrency)))


def wait_idle(base_url: str) -> None:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        text = httpx.get(base_url + "/metrics", timeout=30).text
        if gauge(text, "num_requests_running") == gauge(text, "num_requests_waiting") == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError("requests still in flight after the load stopped")
        time.sleep(0.2)


def run(args: argparse.Namespace) -> SoakReport:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = kvserve_serve_command(
        args.model,
        port,
        "--served-model-name",
        MODEL_NAME,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--kv-cache-memory-bytes",
        str(args.kv_cache_memory_bytes),
    )
    report = SoakReport(duration_s=args.duration_s, concurrency=args.concurrency)
    with open(args.log, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(base_url, process)
        start_s = time.monotonic()
        report.snapshots["start"] = snapshot(base_url, process.pid, start_s)
        warm_up_s = min(args.warm_up_s, args.duration_s)
        asyncio.run(load(base_url, report, start_s + warm_up_s, args.seed))
        report.snapshots["after warm-up"] = snapshot(base_url, process.pid, start_s)

        async def measured_load() -> None:
            deadline_s = start_s + args.duration_s
            sampler = sample_rss(process.pid, report, start_s, deadline_s, args.sample_every_s)
            await asyncio.gather(load(base_url, report, deadline_s, args.seed + 1), sampler)

        asyncio.run(measured_load())
        wait_idle(base_url)
        report.snapshots["end"] = snapshot(base_url, process.pid, start_s)
        process.send_signal(signal.SIGTERM)
        report.exit_status = process.wait(timeout=STOP_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--warm-up-s", type=float, default=30.0, help="RSS drift is measured from after this")
    parser.add_argument("--sample-every-s", type=float, default=60.0, help="RSS sampling interval during the load")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in default model)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=64 << 20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default="soak-server.log", help="the server's output")
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args()

    report = run(args)
    for name, snap in report.snapshots.items():
        print(f"{name:>14}: t={snap.at_s:7.1f} s  RSS {snap.rss_mib:7.1f} MiB  free KV blocks {snap.free_blocks}"
              f"/{snap.total_blocks}")  # fmt: skip
    drift = report.snapshots["end"].rss_mib - report.snapshots["after warm-up"].rss_mib
    print(f"RSS drift after warm-up: {drift:+.1f} MiB")
    print("RSS under load (s, MiB):", " ".join(f"{t:.0f}:{rss:.1f}" for t, rss in report.rss_samples))
    second_half = [(t, rss) for t, rss in report.rss_samples if t >= args.duration_s / 2]
    if len(second_half) >= 2:
        print(f"RSS slope over the second half of the load: {slope_mib_per_hour(second_half):+.2f} MiB/hour")
    print(f"served {sum(report.served.values())} requests: {dict(report.served)}")
    print(f"unexpected answers (errors): {sum(report.unexpected.values())} {dict(report.unexpected)}")
    print(f"server exit status after SIGTERM: {report.exit_status}")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    end = report.snapshots["end"]
    return int(bool(report.unexpected) or end.free_blocks != end.total_blocks or report.exit_status != 0)


if __name__ == "__main__":
    sys.exit(main())
