"""What a step costs outside the model's arithmetic, on the CPU.

1. Ops dispatched in one decode step of a Qwen3-0.6B-shaped model (random weights, fp32), counted by a
   TorchDispatchMode: in decoder layer 0, in the forward and in the core's whole step; and of those, the ones that
   compute (not views, reshapes or allocations): on a GPU, the launches.
2. Host time per step outside the model (the step's wall time less the forward and the logits) with 64 and 256
   running decodes of the built-in default model, part by part (`benchmarks/step_probe.py`, a process of its own
   per measurement): this checkout's engine core, whose outputs are detokenized elsewhere (the output processing
   is timed apart), and, with `--before CHECKOUT`, a checkout before the engine core existed, whose step did
   everything; the two in alternating rounds, medians over the rounds.
3. The prefix cache's keys: SHA-256 over CBOR per full block (and Python's `hash`, for scale), and the time a step
   spends registering blocks with 256 running decodes.
4. Output handling as one request's output grows to 8k tokens (logprobs and a stop string: every part of the output
   path runs): the core's host time and the output processing per step at 100, 1k, 4k and 8k tokens.
5. The same request streamed through `kvserve serve`: the CPU time of the server's HTTP thread (its event loop: the
   output processing, the server's side of each delta, SSE framing) per 1,000 tokens, window by window.

    .venv/bin/python -m benchmarks.step_overhead [--before CHECKOUT] [--rounds 3]
"""

import argparse
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import timeit
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.checkpoints import random_checkpoint
from benchmarks.processes import child_cwd
from benchmarks.servers import free_port, kvserve_serve_command, stop, wait_healthy

QWEN3_0_6B = {
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True,
}  # fmt: skip
LONG_CONTEXT = {
    "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 16384,
}  # fmt: skip
PROBE = Path(__file__).with_name("step_probe.py")


def build(name: str, shape: dict, architecture: str) -> Path:
    """A checkpoint of `shape` (its own vocabulary size: the tokenizer's 400 tokens are a prefix of it)."""
    from transformers import LlamaConfig, Qwen3Config

    config_class = Qwen3Config if architecture == "Qwen3ForCausalLM" else LlamaConfig
    corpus = lambda: "\n".join(f"a line of text number {i} for the tokenizer" for i in range(300))  # noqa: E731
    return random_checkpoint(name, corpus, 400, lambda vocab: config_class(architectures=[architecture], **shape))


class ModelTimer:
    """Seconds spent in the model's forward and logits since the last reset (wraps the two methods)."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        for name in ("forward", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            start_s = time.perf_counter()
            result = method(*args, **kwargs)
            self.seconds += time.perf_counter() - start_s
            return result

        return timed


# Ops that only describe or allocate memory: no kernel runs for them.
NON_COMPUTE_OPS = {"aten.view", "aten.reshape", "aten.slice", "aten.select", "aten.split_with_sizes", "aten.chunk",
                   "aten.unsqueeze", "aten.squeeze", "aten.transpose", "aten.permute", "aten.flatten", "aten.expand",
                   "aten.t", "aten.empty", "aten.empty_like", "aten.alias", "aten.detach", "aten.to"}  # fmt: skip


def computing(counts: Counter) -> int:
    return sum(n for op, n in counts.items() if op not in NON_COMPUTE_OPS)


def count_ops(fn) -> Counter:
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = Counter()

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        fn()
    return counts


def decode_ops(model_dir: Path, backend: str) -> None:
    import torch

    from kvserve.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), kv_cache_memory_bytes=256 << 20, max_num_seqs=8, attention_backend=backend)
    engine, core = llm.engine, llm.engine.core
    for i in range(8):
        engine.add_request([10 + i] * 20, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()
    layer = core.model.model.layers[0]
    layer_counts, forward_counts = Counter(), Counter()
    layer_forward, model_forward = layer.forward, core.model.forward

    def counted(counter, method):
        def run(*args, **kwargs):
            result = []
            counter.update(count_ops(lambda: result.append(method(*args, **kwargs))))
            return result[0]

        return run

    layer.forward = counted(layer_counts, layer_forward)
    core.model.forward = counted(forward_counts, model_forward)
    with torch.inference_mode():
        step_counts = count_ops(core.step)
    print(f"  backend {core.runner.worker.backend.name}: {sum(layer_counts.values())} ops in layer 0, "
          f"{sum(forward_counts.values())} in the forward (28 layers), {sum(step_counts.values())} in the whole step; "
          f"computing: {computing(layer_counts)} in layer 0, {computing(forward_counts)} in the forward, "
          f"{computing(step_counts)} in the step")  # fmt: skip


def probe(layout: str, num_running: int, checkout: Path | None, model_stub: bool) -> dict:
    """One `step_probe.py` run in a process of its own (`checkout` on the path for an older layout)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout)
    command = [sys.executable, "-P", str(PROBE), "--layout", layout, "--num-running", str(num_running)]
    command += ["--model-stub"] if model_stub else []
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def host_time_rounds(before: Path | None, rounds: int, model_stub: bool) -> None:
    runs: dict[tuple[str, int], list[dict]] = {}
    for round_index in range(rounds):
        for num_running in (64, 256):
            layouts = [("after", "kvserve", None)] + ([("before", "old", before)] if before else [])
            for label, layout, checkout in layouts if round_index % 2 == 0 else layouts[::-1]:
                runs.setdefault((label, num_running), []).append(probe(layout, num_running, checkout, model_stub))
    for (label, num_running), results in sorted(runs.items(), key=lambda item: (item[0][1], item[0][0])):
        host = statistics.median(result["host_ms"] for result in results)
        parts = {
            part: statistics.median(result["parts_ms"][part] for result in results) for part in results[0]["parts_ms"]
        }
        line = f"  {label:6} {num_running:3d} running: host {host:.2f} ms a step (rounds: "
        line += ", ".join(f"{result['host_ms']:.2f}" for result in results) + ")"
        if "output_processing_ms" in results[0]:
            outputs = statistics.median(result["output_processing_ms"] for result in results)
            line += f"; output processing, off the step's path: {outputs:.2f} ms"
        print(line)
        print("    mean ms a step: " + ", ".join(f"{part} {ms:.2f}" for part, ms in parts.items()))


def prefix_key_cost() -> None:
    """The cost of one full block's key, and of the keys a step registers with 256 running decodes."""
    from kvserve.engine import LLM, SamplingParams
    from kvserve.engine.default_model import default_model_dir
    from kvserve.kvcache import BlockHasher

    tokens = tuple(range(1000, 1016))
    hasher = BlockHasher()
    parent = hasher.key(None, tokens)
    old_parent = hash(tokens)
    number = 100_000
    sha = timeit.timeit(lambda: hasher.key(parent, tokens), number=number) / number * 1e6
    builtin = timeit.timeit(lambda: hash((old_parent, tokens)), number=number) / number * 1e6
    raw = timeit.timeit(lambda: hashlib.sha256(parent.digest + bytes(64)).digest(), number=number) / number * 1e6
    print(f"  a 16-token block's key: SHA-256 over canonical CBOR, vLLM's sha256_cbor (BlockHasher.key) {sha:.2f} us "
          f"(the digest alone {raw:.2f} us); Python's hash of (parent, tokens): {builtin:.2f} us")  # fmt: skip
    llm = LLM(str(default_model_dir()), max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_memory_bytes=1 << 30)
    engine, scheduler = llm.engine, llm.engine.core.scheduler
    for i in range(256):
        engine.add_request([5 + (i * 7 + j) % 900 for j in range(32)],
                           SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))  # fmt: skip
    for _ in range(5):
        engine.step()
    seconds, num_blocks = 0.0, 0
    register = scheduler._register_full_blocks

    def timed_register(request):
        nonlocal seconds, num_blocks
        before = request.num_registered_blocks
        start_s = time.perf_counter()
        register(request)
        seconds += time.perf_counter() - start_s
        num_blocks += request.num_registered_blocks - before

    scheduler._register_full_blocks = timed_register
    num_steps = 64
    for _ in range(num_steps):
        engine.step()
    print(
        f"  256 running decodes: {num_blocks / num_steps:.1f} blocks registered a step, "
        f"{seconds / num_steps * 1e3:.3f} ms a step ({seconds / max(num_blocks, 1) * 1e6:.2f} us a block, "
        "its key and the allocator's tables)"
    )


def output_cost_by_length(model_dir: Path, checkpoints=(100, 1000, 4000, 8000)) -> dict[int, tuple[float, float]]:
    """(core host us, output processing us) a step, the medians of the 40 steps around each checkpoint."""
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), kv_cache_memory_bytes=1 << 30)
    engine = llm.engine
    timer = ModelTimer(engine.core.model)
    params = SamplingParams(max_tokens=max(checkpoints) + 50, temperature=0.0, ignore_eos=True, logprobs=5,
                            stop=("never appears §",))  # fmt: skip
    engine.add_request([7, 8, 9], params)
    costs, core_us, outputs_us, num_steps = {}, [], [], 0
    while engine.has_unfinished():
        timer.seconds = 0.0
        start_s = time.perf_counter()
        step = engine.core.step()
        middle_s = time.perf_counter()
        engine.process(step)
        core_us.append((middle_s - start_s - timer.seconds) * 1e6)
        outputs_us.append((time.perf_counter() - middle_s) * 1e6)
        num_steps += 1
        if num_steps - 20 in checkpoints:
            costs[num_steps - 20] = (statistics.median(core_us[-40:]), statistics.median(outputs_us[-40:]))
    return costs


def server_cpu_by_window(model_dir: Path, num_tokens: int = 8000, window: int = 1000) -> list[float]:
    """CPU seconds of the server's main (HTTP) thread per `window` tokens streamed, window by window."""
    port = free_port()
    server = subprocess.Popen(kvserve_serve_command(model_dir, port), cwd=child_cwd(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip

    def cpu_seconds() -> float:
        fields = Path(f"/proc/{server.pid}/task/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        body = {"model": model_dir.name, "prompt": [7, 8, 9], "max_tokens": num_tokens, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 5, "stop": ["never appears §"], "stream": True}  # fmt: skip
        marks, tokens = [cpu_seconds()], 0
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    tokens += sum(len(c["logprobs"]["tokens"]) for c in chunk["choices"] if c.get("logprobs"))
                    if tokens >= window * len(marks):
                        marks.append(cpu_seconds())
        return [later - earlier for earlier, later in itertools.pairwise(marks)]
    finally:
        stop(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, default=None, help="a checkout to compare with (before the namespace)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of part 2")
    parser.add_argument("--parts", default="1,2,3,4,5", help="which parts to run")
    parser.add_argument("--backends", default="auto,torch", help="backends for the op count")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if "1" in parts:
        qwen = build("bench-step-overhead-qwen3-0.6b-shaped", QWEN3_0_6B, "Qwen3ForCausalLM")
        print("1. ops dispatched in one decode step, 8 running, Qwen3-0.6B shape:")
        for backend in args.backends.split(","):
            decode_ops(qwen, backend)
    if "2" in parts:
        for model_stub in (False, True):
            model = "no forward (a stub: host work on warm caches, as beside a GPU)" if model_stub else "the model runs"
            print(f"2. host time per step outside the model (built-in default model), {model}, {args.rounds} "
                  "alternating rounds, medians of 40 steps each:")  # fmt: skip
            host_time_rounds(args.before, args.rounds, model_stub)
    if "3" in parts:
        print("3. prefix-cache keys:")
        prefix_key_cost()
    long_model = (
        build("bench-step-overhead-long-context", LONG_CONTEXT, "LlamaForCausalLM") if {"4", "5"} & parts else None
    )
    if "4" in parts:
        print("4. one request (logprobs 5, a stop string), host time per step by output length:")
        for length, (core_us, outputs_us) in output_cost_by_length(long_model).items():
            print(f"  {length:5d} tokens: core {core_us:.0f} us, output processing {outputs_us:.0f} us")
    if "5" in parts:
        windows = server_cpu_by_window(long_model)
        print("5. server HTTP-thread CPU per 1,000 streamed tokens (the same request over HTTP), window by window:")
        print("  " + ", ".join(f"{seconds * 1e3:.0f} ms" for seconds in windows))


if __name__ == "__main__":
    main()
