"""compressed-tensors checkpoints against the dense model they were made from, end to end on a CPU: output tokens a
second of the offline engine at one request and at 32, and the weights' resident bytes, for the Qwen2-0.5B layer
shapes (random weights) in float32 and quantized by llm-compressor (W8A16: int8 in groups of 128; W4A16: int4 in
groups of 128), in alternating rounds.

llm-compressor pins its own transformers, so it runs from a virtual environment of its own (see
kvserve/testing/compressed_tensors_fixtures.py for how to make one):

    .venv/bin/python -m benchmarks.compressed_tensors_decode --llmc-python /tmp/llmc/bin/python [--rounds 2]
"""

import argparse
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.vs_llama_cpp import qwen2_0_5b_dir
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.models.layers import weight_bytes

SCHEMES = ("W8A16", "W4A16")
# Runs in llm-compressor's environment: round-to-nearest quantization needs no calibration data.
_QUANTIZE = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
source, out, scheme = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
model.save_pretrained(out, save_compressed=True)
AutoTokenizer.from_pretrained(source).save_pretrained(out)
"""
KV_CACHE_BYTES = 1 << 30
OUTPUT_TOKENS = 64
# batch: requests (all sent at once, so `batch` decode together)
BATCHES = {1: 2, 32: 32}


def quantized_dir(llmc_python: str, source: Path, scheme: str) -> Path:
    out = source.with_name(f"{source.name}-{scheme.lower()}")
    if not (out / "config.json").is_file():
        subprocess.run([llmc_python, "-P", "-c", _QUANTIZE, str(source), str(out), scheme], check=True)
    return out


def run(model: Path) -> dict[str, float]:
    results = {}
    with LLM(str(model), kv_cache_memory_bytes=KV_CACHE_BYTES, max_num_seqs=32) as llm:
        results["weights MiB"] = weight_bytes(llm.engine.core.runner.worker.model) / 2**20
        params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
        llm.generate([[5, 6, 7, 8]], params)  # warm-up
        for batch, requests in BATCHES.items():
            prompts = [[10 + i, 20 + i, 30 + i, 40 + i] * 8 for i in range(requests)]
            start = time.perf_counter()
            for first in range(0, requests, batch):
                llm.generate(prompts[first : first + batch], params)
            results[f"tok/s at {batch}"] = requests * OUTPUT_TOKENS / (time.perf_counter() - start)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llmc-python", required=True, help="python of an environment with llmcompressor")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    dense = qwen2_0_5b_dir()
    models = {"dense f32": dense, **{scheme: quantized_dir(args.llmc_python, dense, scheme) for scheme in SCHEMES}}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    for round_index in range(args.rounds):
        for name, path in models.items():
            rounds[name].append(run(path))
            print(f"round {round_index + 1} {name}: {rounds[name][-1]}", flush=True)
    print("medians (ratio to dense):")
    base = {key: statistics.median(r[key] for r in rounds["dense f32"]) for key in rounds["dense f32"][0]}
    for name, results in rounds.items():
        medians = {key: statistics.median(r[key] for r in results) for key in results[0]}
        print(f"  {name:10} " + "; ".join(f"{key} {value:.1f} ({value / base[key]:.2f}x)" for key, value in
                                          medians.items()))  # fmt: skip


if __name__ == "__main__":
    main()
