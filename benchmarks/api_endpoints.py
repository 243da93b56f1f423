"""The same workload through each generation API of one kvserve server: chat completions, OpenAI's Responses and
Anthropic's Messages (and completions), `kvserve bench --endpoint ...` run in alternating rounds against one server
(prefix cache off, as every endpoint gets the same prompts), so the protocols' own cost (translation, their stream
events) is all that differs; completions has no chat template, so its prompts are a few tokens shorter. Reports the
median output tokens/s and TTFT per endpoint and each one's ratio to chat.

    .venv/bin/python -m benchmarks.api_endpoints --rounds 3                 # Qwen2-0.5B layer shapes
    .venv/bin/python -m benchmarks.api_endpoints --model llama-45m --rounds 3
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.checkpoints import llama_45m_dir
from benchmarks.processes import child_cwd
from benchmarks.servers import SERVED_MODEL_NAME, free_port, kvserve_serve_command, serving
from benchmarks.vs_llama_cpp import qwen2_0_5b_dir

ENDPOINTS = ("chat", "responses", "messages", "completions")
CLIENT_TIMEOUT_S = 1800


def run_bench(base_url: str, endpoint: str, model_dir: Path, args, out_file: Path) -> dict:
    command = [
        sys.executable, "-P", "-m", "kvserve.server.cli", "bench", "--base-url", base_url, "--endpoint", endpoint,
        "--model", SERVED_MODEL_NAME, "--tokenizer", str(model_dir), "--num-prompts", str(args.num_prompts),
        "--random-input-len", str(args.input_len), "--max-tokens", str(args.output_len), "--random-range-ratio", "0.5",
        "--ignore-eos", "--max-concurrency", str(args.concurrency), "--seed", "0", "--json", str(out_file),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=child_cwd(), capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"kvserve bench --endpoint {endpoint} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(out_file.read_text())["summary"]
    return {"output tok/s": summary["output_tokens_per_s"], "TTFT median (ms)": summary["ttft"]["median_ms"],
            "output tokens": summary["total_output_tokens"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("qwen2-0.5b", "llama-45m"), default="qwen2-0.5b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--endpoints", default=",".join(ENDPOINTS))
    args = parser.parse_args()
    endpoints = args.endpoints.split(",")
    model_dir = qwen2_0_5b_dir() if args.model == "qwen2-0.5b" else llama_45m_dir()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    # Every endpoint gets the same prompts: without the prefix cache, each run computes them all.
    command = kvserve_serve_command(model_dir, port, "--served-model-name", SERVED_MODEL_NAME,
                                    "--kv-cache-memory-bytes", str(2 << 30), "--no-enable-prefix-caching")  # fmt: skip
    process = subprocess.Popen(command, cwd=child_cwd(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    figures: dict[str, list[dict]] = {endpoint: [] for endpoint in endpoints}
    with tempfile.TemporaryDirectory() as out_dir, serving(process, base_url):
        run_bench(base_url, "chat", model_dir, argparse.Namespace(**{**vars(args), "num_prompts": 8}),
                  Path(out_dir) / "warmup.json")  # fmt: skip
        for round_index in range(args.rounds):
            # Each round starts with the next endpoint, so none always runs first (or after the same one).
            order = endpoints[round_index % len(endpoints) :] + endpoints[: round_index % len(endpoints)]
            for endpoint in order:
                result = run_bench(base_url, endpoint, model_dir, args, Path(out_dir) / f"{endpoint}.json")
                figures[endpoint].append(result)
                print(f"round {round_index + 1} {endpoint:12s} {result['output tok/s']:8.1f} tok/s  "
                      f"TTFT median {result['TTFT median (ms)']:8.1f} ms", flush=True)  # fmt: skip
    print(f"\n{args.model}, {args.num_prompts} requests at concurrency {args.concurrency}, {args.input_len} +- 50% "
          f"in / {args.output_len} +- 50% out (ignore_eos), medians of {args.rounds} alternating rounds")  # fmt: skip
    chat_tok_s = statistics.median(result["output tok/s"] for result in figures["chat"]) if "chat" in figures else None
    print(f"{'endpoint':12s} {'output tok/s':>13s} {'vs chat':>8s} {'TTFT median (ms)':>17s} {'rounds (tok/s)':>30s}")
    for endpoint, results in figures.items():
        tok_s = statistics.median(result["output tok/s"] for result in results)
        ttft = statistics.median(result["TTFT median (ms)"] for result in results)
        ratio = f"{tok_s / chat_tok_s:.3f}" if chat_tok_s else "-"
        rounds = ", ".join(f"{result['output tok/s']:.1f}" for result in results)
        print(f"{endpoint:12s} {tok_s:13.1f} {ratio:>8s} {ttft:17.1f} {rounds:>30s}")


if __name__ == "__main__":
    main()
