"""kvserve against llama.cpp's own `llama-server` on the same GGUF files, served, in alternating rounds.

    bash ../shared/peers/llama-cpp.sh /tmp/llama-cpp         # llama.cpp's converter, quantizer and server (once)
    .venv/bin/python -m benchmarks.vs_llama_cpp --llama-cpp /tmp/llama-cpp [--rounds 2] [--types Q8_0,Q4_K_M]

The model has the Qwen2-0.5B layer shapes (24 layers, hidden 896, 14/2 heads of 64, MLP 4864, tied embeddings,
151936-row vocabulary) with random weights and a 32k BPE tokenizer trained here; llama.cpp's converter writes it as
an F32 GGUF and its llama-quantize makes each type. Both servers get 2 threads; llama-server 32 parallel slots
sharing a 16k context, kvserve a KV cache of as many tokens. One client, `kvserve bench`, sends both the same random
prompts (96 tokens +-50%) for 128 output tokens +-50% with `ignore_eos` (its range applies to both, as `vllm bench
serve`'s does), at concurrency 32 (32 requests) and 1 (2 requests). Printed per round and as medians: output tok/s,
TTFT and TPOT p50, peak RSS of the server's process tree, and the kvserve / llama.cpp ratios.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import Qwen2Config

from benchmarks.checkpoints import random_checkpoint, synthetic_corpus
from benchmarks.processes import TreeRSS, child_cwd, child_env
from benchmarks.servers import free_port, kvserve_serve_command, serving
from kvserve.engine.default_model import cache_root
from kvserve.testing.gguf_fixtures import convert, quantize

CONCURRENCY_PROMPTS = {32: 32, 1: 2}  # concurrency: requests sent
# The same tokens of KV cache as llama-server's -c 16384: 24 layers x K and V x 2 heads x 64 x 4 bytes (float32) each.
KV_CACHE_BYTES = 16384 * 24 * 2 * 2 * 64 * 4


def qwen2_0_5b_dir() -> Path:
    """The Qwen2-0.5B layer shapes, random weights, a 32k tokenizer (the model's vocabulary rows beyond it unused)."""
    return random_checkpoint(
        "bench-qwen2-0.5b-shapes-v1", synthetic_corpus, 32000,
        lambda vocab_size: Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, architectures=["Qwen2ForCausalLM"],
        ),
    )  # fmt: skip


def gguf_files(llama_cpp: Path, hf_dir: Path, types: list[str]) -> dict[str, Path]:
    """Each type's GGUF file, made once beside the checkpoint by llama.cpp's converter and quantizer."""
    out_dir = cache_root() / "bench-qwen2-0.5b-shapes-gguf-v1"
    out_dir.mkdir(parents=True, exist_ok=True)
    f32 = out_dir / "model-f32.gguf"
    if not f32.exists():
        convert(llama_cpp, hf_dir, f32)
    files = {}
    for kind in types:
        files[kind] = out_dir / f"model-{kind.lower()}.gguf"
        if not files[kind].exists():
            quantize(llama_cpp, f32, files[kind], kind, [])
    return files


def server_command(engine: str, llama_cpp: Path, model: Path, port: int) -> list[str]:
    if engine == "kvserve":
        return kvserve_serve_command(model, port, "--served-model-name", "bench", "--max-num-seqs", "32",
                                     "--kv-cache-memory-bytes", str(KV_CACHE_BYTES))  # fmt: skip
    return [str(llama_cpp / "build/bin/llama-server"), "-m", str(model), "-a", "bench", "-c", "16384", "-np", "32",
            "-t", "2", "-tb", "2", "--host", "127.0.0.1", "--port", str(port), "--no-webui"]  # fmt: skip


def run_served(engine: str, llama_cpp: Path, model: Path, tokenizer: Path, log_dir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (log_dir / f"{engine}-{model.stem}.log").open("ab")
    process = subprocess.Popen(server_command(engine, llama_cpp, model, port), env=child_env(), cwd=child_cwd(),
                               stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    rss = TreeRSS(process.pid)
    results = {}
    try:
        with serving(process, url):
            for concurrency, prompts in CONCURRENCY_PROMPTS.items():
                out = log_dir / f"{engine}-{model.stem}-{concurrency}-{int(time.time() * 1000)}.json"
                client = [sys.executable, "-P", "-m", "kvserve.server.cli", "bench", "--base-url", url,
                          "--model", "bench", "--num-prompts", str(prompts), "--random-input-len", "96",
                          "--random-range-ratio", "0.5",
                          "--random-output-len", "128", "--ignore-eos", "--temperature", "0", "--seed", "0",
                          "--max-concurrency", str(concurrency), "--tokenizer", str(tokenizer),
                          "--json", str(out)]  # fmt: skip
                done = subprocess.run(client, env=child_env(), cwd=child_cwd(), capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(
                        f"kvserve bench against {engine} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
                    )
                summary = json.loads(out.read_text())["summary"]
                results[concurrency] = {
                    "tok_s": summary["output_tokens_per_s"], "ttft_p50_ms": summary["ttft"]["median_ms"],
                    "tpot_p50_ms": summary["tpot"]["median_ms"], "output_tokens": summary["total_output_tokens"],
                }  # fmt: skip
    finally:
        peak_rss = rss.stop()
        log.close()
    return {"by_concurrency": results, "peak_rss_mib": peak_rss / 2**20}


def summarise(kind: str, rounds: list[dict[str, dict]]) -> None:
    print(f"\n== {kind}: medians of {len(rounds)} alternating rounds ==")
    print(f"{'figure':24}{'kvserve':>12}{'llama.cpp':>12}{'kvserve/llama.cpp':>20}")
    for concurrency in CONCURRENCY_PROMPTS:
        for figure in ("tok_s", "ttft_p50_ms", "tpot_p50_ms"):
            medians = [statistics.median(r[e]["by_concurrency"][concurrency][figure] for r in rounds)
                       for e in ("kvserve", "llama")]  # fmt: skip
            print(
                f"{f'c={concurrency} {figure}':24}{medians[0]:12.1f}{medians[1]:12.1f}{medians[0] / medians[1]:20.3f}"
            )
    rss = [statistics.median(r[e]["peak_rss_mib"] for r in rounds) for e in ("kvserve", "llama")]
    print(f"{'peak RSS MiB':24}{rss[0]:12.0f}{rss[1]:12.0f}{rss[0] / rss[1]:20.3f}")
    per_round = [
        r["kvserve"]["by_concurrency"][32]["tok_s"] / r["llama"]["by_concurrency"][32]["tok_s"] for r in rounds
    ]
    print(f"c=32 tok/s ratio per round: {', '.join(f'{x:.3f}' for x in per_round)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama-cpp"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--types", default="Q8_0,Q4_K_M")
    args = parser.parse_args()
    hf_dir = qwen2_0_5b_dir()
    files = gguf_files(args.llama_cpp, hf_dir, args.types.split(","))
    log_dir = Path(tempfile.mkdtemp(prefix="vs-llama-cpp-"))
    print(f"logs and client results in {log_dir}")
    for kind, path in files.items():
        print(f"\n{kind}: {path} ({path.stat().st_size / 2**20:.0f} MiB)")
        rounds = []
        for index in range(args.rounds):
            order = ("kvserve", "llama") if index % 2 == 0 else ("llama", "kvserve")
            result = {engine: run_served(engine, args.llama_cpp, path, hf_dir, log_dir) for engine in order}
            rounds.append(result)
            for engine in ("kvserve", "llama"):
                figures = result[engine]["by_concurrency"]
                rss_mib = result[engine]["peak_rss_mib"]
                print(f"  round {index + 1} {engine:8} c=32 {figures[32]['tok_s']:7.1f} tok/s  c=1 "
                      f"{figures[1]['tok_s']:6.1f} tok/s  RSS {rss_mib:6.0f} MiB", flush=True)  # fmt: skip
        summarise(kind, rounds)


if __name__ == "__main__":
    main()
