"""kvserve replicas behind a router from PyPI: round-robin against prefix-aware routing, on loopback.

    python3 -m venv /tmp/router-venv && /tmp/router-venv/bin/pip install vllm-router==0.1.17
    .venv/bin/python -m benchmarks.replicas --router-venv /tmp/router-venv --rounds 2

N `kvserve serve` replicas (--replicas, default 2) of the 45M Llama of benchmarks/vs_vllm.py, each pinned to a core
of its own (taskset) with one torch thread and a KV cache of --kv-cache-mib, behind `vllm-router` with each of
--policies:
- round_robin: requests go to the replicas in turn;
- cache_aware: the router's own approximate radix tree of the text it sent each replica (balancing load when it
  is uneven);
- kv_aware: the router's index of each replica's blocks, fed by kvserve's KV-cache events (--kv-events-endpoint,
  vLLM's format) and the block hashes it recomputes from the prompt's tokens.

Workloads, each --conversations conversations of --turns turns, --concurrency conversations at a time:
- shared: --system-prompts system prompts of 1000-1500 tokens; conversation i opens with prompt i mod that count;
- no-sharing: every conversation its own system prompt of the same lengths.
A turn's prompt is the system prompt, the turns before (each user message and the reply the model gave) and a new
user message of ~48 tokens; 32 tokens come back (greedy, ignore_eos), streamed (/v1/completions). A replica's KV
cache (64 MiB: 8k tokens) holds about 4 of the 8 system prompts besides the conversations in flight: round-robin
sends all 8 to each replica, which then evicts them in turn, where prefix-aware routing can keep each prompt on one
replica.

Each (policy, workload) run starts fresh replicas and a fresh router; rounds alternate the policies' order. Printed
per run and as medians over the rounds: TTFT p50 and p90, output tokens/s, and each replica's requests and
prefix-cache hit rate (from its /metrics: hit tokens / queried tokens over the run).
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.checkpoints import llama_45m_dir, synthetic_corpus
from benchmarks.processes import child_cwd, child_env, command_line
from benchmarks.servers import SERVED_MODEL_NAME, free_port, kvserve_serve_command, stop, wait_healthy

POLICIES = ("round_robin", "cache_aware", "kv_aware")
WORKLOADS = ("shared", "no-sharing")
ROUTER_STARTUP_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 600
USER_TOKENS = 48
OUTPUT_TOKENS = 32


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft_s: float
    output_tokens: int


@dataclass
class RunResult:
    policy: str
    workload: str
    turns: list[Turn]
    wall_s: float
    replicas: list[dict]  # per replica: requests, queried and hit prompt tokens over the run

    def ttft_ms(self, quantile: float) -> float:
        values = sorted(turn.ttft_s for turn in self.turns)
        return values[min(len(values) - 1, int(quantile * len(values)))] * 1e3

    @property
    def output_tokens_per_s(self) -> float:
        return sum(turn.output_tokens for turn in self.turns) / self.wall_s

    def hit_rates(self) -> list[float]:
        return [replica["hit"] / max(replica["queried"], 1) for replica in self.replicas]


# ---- The workload ----


class Words:
    """Pseudo-words of the checkpoint's synthetic corpus, and the tokenizer to size texts in tokens."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.words = sorted({word for line in synthetic_corpus().splitlines()[:2000] for word in line.split()})

    def text(self, rng: random.Random, num_tokens: int) -> str:
        """Random words, cut to about `num_tokens` tokens."""
        words = rng.choices(self.words, k=num_tokens)
        ids = self.tokenizer(" ".join(words), add_special_tokens=False).input_ids[:num_tokens]
        return self.tokenizer.decode(ids)


@dataclass(frozen=True)
class Conversation:
    system: str
    user_messages: tuple[str, ...]


def make_conversations(args: argparse.Namespace, words: Words, workload: str) -> list[Conversation]:
    rng = random.Random(0)
    num_systems = args.system_prompts if workload == "shared" else args.conversations
    systems = [words.text(rng, rng.randint(1000, 1500)) for _ in range(num_systems)]
    return [
        Conversation(systems[index % num_systems], tuple(words.text(rng, USER_TOKENS) for _ in range(args.turns)))
        for index in range(args.conversations)
    ]


async def run_conversations(base_url: str, conversations: list[Conversation], concurrency: int) -> list[Turn]:
    slots = asyncio.Semaphore(concurrency)
    turns: list[Turn] = []
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:

        async def converse(index: int, conversation: Conversation) -> None:
            async with slots:
                history = conversation.system
                for number, message in enumerate(conversation.user_messages):
                    prompt = f"{history}\nUser: {message}\nAssistant:"
                    ttft_s, reply, num_tokens = await _stream_completion(client, base_url, prompt)
                    turns.append(Turn(index, number, ttft_s, num_tokens))
                    history = prompt + reply

        await asyncio.gather(*(converse(i, conversation) for i, conversation in enumerate(conversations)))
    return turns


async def _stream_completion(client: httpx.AsyncClient, base_url: str, prompt: str) -> tuple[float, str, int]:
    """(seconds to the first token, the text, tokens) of one streamed completion."""
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start_s, first_s, text, num_tokens = time.perf_counter(), None, [], 0
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("choices"):  # a token came (its text may be empty: part of a character)
                first_s = first_s or time.perf_counter()
                text.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    if first_s is None or num_tokens != OUTPUT_TOKENS:  # ignore_eos: every turn is OUTPUT_TOKENS long
        raise RuntimeError(f"a completion came back with {num_tokens} tokens, not {OUTPUT_TOKENS}")
    return first_s - start_s, "".join(text), num_tokens


# ---- Replicas and the router ----


@dataclass(frozen=True)
class Replica:
    url: str
    events_endpoint: str
    process: subprocess.Popen


@contextmanager
def replicas(args: argparse.Namespace, model_dir: Path, tmp: Path):
    """`args.replicas` fresh servers, replica i on core i mod the cores, each publishing its KV-cache events."""
    started: list[Replica] = []
    try:
        for index in range(args.replicas):
            port, events_port = free_port(), free_port()
            # Bound on every interface, as vLLM binds `tcp://*:port`; nothing but the router on loopback reads it.
            endpoint = f"tcp://*:{events_port}"
            flags = ["--served-model-name", SERVED_MODEL_NAME, "--kv-cache-memory-bytes", str(args.kv_cache_mib << 20),
                     "--max-num-seqs", "32", "--kv-events-endpoint", endpoint, "--no-console"]  # fmt: skip
            command = ["taskset", "-c", str(index % os.cpu_count()), *kvserve_serve_command(model_dir, port, *flags)]
            log = (tmp / f"replica-{index}.log").open("w")
            env = child_env(OMP_NUM_THREADS="1")
            process = subprocess.Popen(command, cwd=child_cwd(), env=env, stdout=log, stderr=subprocess.STDOUT)
            started.append(Replica(f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events_port}", process))
        for replica in started:
            wait_healthy(replica.url, replica.process)
        yield started
    finally:
        for replica in started:
            stop(replica.process)


@contextmanager
def router(args: argparse.Namespace, policy: str, workers: list[Replica], model_dir: Path, tmp: Path):
    port = free_port()
    command = [str(args.router_venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
               "--policy", policy, "--worker-urls", *(worker.url for worker in workers),
               "--prometheus-port", str(free_port()), "--log-level", "warning"]  # fmt: skip
    if policy == "kv_aware":
        for worker in workers:
            command += ["--kv-event-source", f"{worker.url}={worker.events_endpoint}"]
        command += ["--kv-event-block-size", "16", "--kv-event-model", str(model_dir)]
    log = (tmp / f"router-{policy}.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_router(url, process, tmp / f"router-{policy}.log")
        yield url
    finally:
        stop(process, timeout_s=10)


def _wait_for_router(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + ROUTER_STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the router exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the router did not answer in time:\n{log.read_text()[-3000:]}")


def replica_counts(workers: list[Replica]) -> list[dict]:
    """Each replica's finished requests and prefix-cache prompt tokens so far, from its /metrics."""
    counts = []
    for worker in workers:
        text = httpx.get(f"{worker.url}/metrics", timeout=30).text
        counts.append({
            "requests": _sum_samples(text, "kvserve:requests_finished_total"),
            "queried": _sum_samples(text, "kvserve:prefix_cache_queried_tokens_total"),
            "hit": _sum_samples(text, "kvserve:prefix_cache_hit_tokens_total"),
        })  # fmt: skip
    return counts


def _sum_samples(exposition: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines() if line.startswith(name + "{"))


def run_once(args, policy: str, workload: str, model_dir: Path, conversations: list[Conversation]) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="kvserve-replicas-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        workers = stack.enter_context(replicas(args, model_dir, tmp))
        url = stack.enter_context(router(args, policy, workers, model_dir, tmp))
        before = replica_counts(workers)
        start_s = time.perf_counter()
        turns = asyncio.run(run_conversations(url, conversations, args.concurrency))
        wall_s = time.perf_counter() - start_s
        after = replica_counts(workers)
    deltas = [{key: end[key] - begin[key] for key in end} for begin, end in zip(before, after, strict=True)]
    return RunResult(policy, workload, turns, wall_s, deltas)


def describe(result: RunResult) -> str:
    per_replica = ", ".join(
        f"{int(replica['requests'])} req {rate:.0%} hit"
        for replica, rate in zip(result.replicas, result.hit_rates(), strict=True)
    )
    return (f"TTFT p50 {result.ttft_ms(0.5):7.0f} ms  p90 {result.ttft_ms(0.9):7.0f} ms  "
            f"{result.output_tokens_per_s:6.1f} tok/s  replicas: {per_replica}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router-venv", type=Path, required=True, help="a venv with vllm-router installed")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8, help="conversations in flight at once")
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="each replica's KV cache (8 KiB a token)")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args()

    model_dir = llama_45m_dir()
    words = Words(model_dir)
    print(command_line(__spec__.name))
    print(f"{args.replicas} replicas of {model_dir.name}, one core and one torch thread each, "
          f"{args.kv_cache_mib} MiB KV cache each; vllm-router from {args.router_venv}")  # fmt: skip
    results: list[RunResult] = []
    for workload in args.workloads:
        conversations = make_conversations(args, words, workload)
        for round_index in range(args.rounds):
            order = args.policies if round_index % 2 == 0 else list(reversed(args.policies))
            for policy in order:
                result = run_once(args, policy, workload, model_dir, conversations)
                results.append(result)
                print(f"round {round_index + 1} {workload:10} {policy:12} {describe(result)}", flush=True)
    summarize(results, args)


def summarize(results: list[RunResult], args: argparse.Namespace) -> None:
    print("\nmedians over the rounds:")
    rows = []
    for workload in args.workloads:
        baseline = None
        for policy in args.policies:
            runs = [result for result in results if result.policy == policy and result.workload == workload]
            p50 = statistics.median(run.ttft_ms(0.5) for run in runs)
            p90 = statistics.median(run.ttft_ms(0.9) for run in runs)
            tok_s = statistics.median(run.output_tokens_per_s for run in runs)
            hit = statistics.median(statistics.mean(run.hit_rates()) for run in runs)
            baseline = baseline or (p90, tok_s)
            rows.append({"workload": workload, "policy": policy, "ttft_p50_ms": p50, "ttft_p90_ms": p90,
                         "output_tokens_per_s": tok_s, "mean_hit_rate": hit})  # fmt: skip
            print(f"  {workload:10} {policy:12} TTFT p50 {p50:7.0f} ms  p90 {p90:7.0f} ms "
                  f"({p90 / baseline[0]:.2f}x {args.policies[0]})  {tok_s:6.1f} tok/s "
                  f"({tok_s / baseline[1]:.2f}x)  mean hit rate {hit:.0%}")  # fmt: skip
    if args.json:
        runs = [{"policy": r.policy, "workload": r.workload, "wall_s": r.wall_s, "replicas": r.replicas,
                 "ttft_s": [t.ttft_s for t in r.turns]} for r in results]  # fmt: skip
        args.json.write_text(json.dumps({"medians": rows, "runs": runs}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
