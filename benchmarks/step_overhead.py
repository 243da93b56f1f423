"""What a step costs outside the model's arithmetic, on the CPU (issue 16's figures).

1. Ops dispatched in one decode step of a Qwen3-0.6B-shaped model (random weights, fp32), counted
   by a TorchDispatchMode: in decoder layer 0, in the whole forward, and in the whole engine step;
   and of those, the ones that compute (not views, reshapes or allocations): on a GPU, the launches.
2. Host time per step outside the forward (scheduler, input preparation, sampler, output
   processing) with 64 and 256 running decodes, on the built-in default model (a small model, so
   the model's own time does not hide the rest): step wall time minus the model's forward and logits.
3. Output handling per step as one request's output grows to 8k tokens, with logprobs and a stop
   string (everything the output path does): host time outside the forward at 100, 1k, 4k and 8k
   tokens, on a small model with a 16k context.
4. The same request streamed through `kvserve serve` (the CLI, in its own process): the CPU time of
   the server's HTTP thread (event loop: the server's side of each delta, SSE framing) per 1,000
   tokens, window by window, read from /proc while the client streams. (The engine thread's time
   grows with the context, as attention reads more of it; this thread's should not.)

Only `LLM`, `engine.step()` and the model's `forward`/`compute_logits` are used, so the same script
measures an older checkout (`--repo PATH` puts that checkout first on the import path).

    python benchmarks/step_overhead.py
"""

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QWEN3_0_6B = {
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True,
}  # fmt: skip


def build(shape: dict, out_dir: Path, architecture: str = "Qwen3ForCausalLM") -> Path:
    from transformers import LlamaConfig, Qwen3Config

    from kvserve.testing.tiny_checkpoint import train_tokenizer, write_random_checkpoint

    tokenizer = train_tokenizer("\n".join(f"a line of text number {i} for the tokenizer" for i in range(300)), 400)
    config_class = Qwen3Config if architecture == "Qwen3ForCausalLM" else LlamaConfig
    return write_random_checkpoint(config_class(architectures=[architecture], **shape), tokenizer, out_dir, seed=0)


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

    extra = {"attention_backend": backend} if backend != "auto" else {}
    llm = LLM(str(model_dir), kv_cache_memory_bytes=256 << 20, max_num_seqs=8, **extra)
    engine = llm.engine
    for i in range(8):
        engine.add_request([10 + i] * 20, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()
    layer = engine.model.model.layers[0]
    layer_counts, forward_counts = Counter(), Counter()
    layer_forward, model_forward = layer.forward, engine.model.forward

    def counted(counter, method):
        def run(*args, **kwargs):
            result = []
            counter.update(count_ops(lambda: result.append(method(*args, **kwargs))))
            return result[0]

        return run

    layer.forward = counted(layer_counts, layer_forward)
    engine.model.forward = counted(forward_counts, model_forward)
    with torch.inference_mode():
        step_counts = count_ops(engine.step)
    total = sum(step_counts.values())
    print(f"  backend {engine.runner.backend.name if hasattr(engine, 'runner') else backend}: "
          f"{sum(layer_counts.values())} ops in layer 0, {sum(forward_counts.values())} in the forward "
          f"(28 layers), {total} in the whole step; computing: {computing(layer_counts)} in layer 0, "
          f"{computing(forward_counts)} in the forward, {computing(step_counts)} in the step")  # fmt: skip
    print(f"    layer 0: {dict(layer_counts.most_common())}")


# Engine parts timed for the breakdown: (attribute path from the engine, method).
ENGINE_PARTS = {"scheduling": ("scheduler", "schedule"), "inputs": ("runner.inputs", "prepare"),
                "sampling rows": ("", "_sampling_row"), "recording the step": ("scheduler", "update"),
                "detokenizing and stop checks": ("", "_process_token")}  # fmt: skip


class PhaseTimer:
    """Seconds spent in each engine part of `ENGINE_PARTS` that this checkout has."""

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = {}
        for part, (path, method) in ENGINE_PARTS.items():
            owner = engine
            for name in filter(None, path.split(".")):
                owner = getattr(owner, name, None)
            if owner is not None and hasattr(owner, method):
                self.seconds[part] = 0.0
                setattr(owner, method, self._timed(part, getattr(owner, method)))

    def _timed(self, part: str, method):
        def timed(*args, **kwargs):
            start_s = time.perf_counter()
            result = method(*args, **kwargs)
            self.seconds[part] += time.perf_counter() - start_s
            return result

        return timed


def host_overhead(model_dir: Path, num_running: int, num_steps: int = 40) -> tuple[float, dict[str, float]]:
    """Median host ms per step outside the forward, then (over as many more steps, timed part by part,
    which adds a little) the mean ms per step of each engine part."""
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), max_num_seqs=num_running, max_num_batched_tokens=8192, kv_cache_memory_bytes=1 << 30)
    engine = llm.engine
    timer = ModelTimer(engine.model)
    for i in range(num_running):
        prompt = [5 + (i * 7 + j) % 900 for j in range(32)]
        engine.add_request(prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(5):  # prefills, then steady decoding
        engine.step()
    host_ms = []
    for _ in range(num_steps):
        timer.seconds = 0.0
        start_s = time.perf_counter()
        engine.step()
        host_ms.append((time.perf_counter() - start_s - timer.seconds) * 1e3)
    phases = PhaseTimer(engine)
    for _ in range(num_steps):
        engine.step()
    return statistics.median(host_ms), {part: s * 1e3 / num_steps for part, s in phases.seconds.items()}


def output_cost_by_length(model_dir: Path, checkpoints=(100, 1000, 4000, 8000)) -> dict[int, float]:
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), kv_cache_memory_bytes=1 << 30)
    engine = llm.engine
    timer = ModelTimer(engine.model)
    params = SamplingParams(max_tokens=max(checkpoints) + 50, temperature=0.0, ignore_eos=True, logprobs=5,
                            stop=("never appears §",))  # fmt: skip
    engine.add_request([7, 8, 9], params)
    costs, samples, num_steps = {}, [], 0
    while engine.has_unfinished():
        timer.seconds = 0.0
        start_s = time.perf_counter()
        engine.step()
        num_steps += 1
        samples.append((time.perf_counter() - start_s - timer.seconds) * 1e6)
        if num_steps - 20 in checkpoints:  # the median of the 40 steps around each checkpoint
            costs[num_steps - 20] = statistics.median(samples[-40:])
    return costs


def server_cpu_by_window(model_dir: Path, repo: Path, num_tokens: int = 8000, window: int = 1000) -> list[float]:
    """CPU seconds of the server's main (HTTP) thread per `window` tokens streamed, window by window."""
    import json
    import os
    import subprocess

    import httpx

    sys.path.insert(0, str(Path(__file__).parent))
    from servers import free_port, stop, wait_healthy

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(repo))
    server = subprocess.Popen(
        [sys.executable, "-P", "-m", "kvserve.server.cli", "serve", str(model_dir), "--port", str(port)],
        env=env, cwd=repo,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

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
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to measure (default: this one)")
    parser.add_argument("--backends", default="auto,torch", help="backends for the op count")
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo))
    from kvserve.engine.default_model import default_model_dir

    print(f"measuring {args.repo}")
    with tempfile.TemporaryDirectory() as tmp:
        qwen = build(QWEN3_0_6B, Path(tmp) / "qwen3-0.6b-shaped")
        print("1. ops dispatched in one decode step, 8 running, Qwen3-0.6B shape:")
        for backend in args.backends.split(","):
            decode_ops(qwen, backend)
        print("2. host time per step outside the forward (built-in default model), median of 40 steps:")
        for num_running in (64, 256):
            median_ms, parts = host_overhead(default_model_dir(), num_running)
            breakdown = ", ".join(f"{part} {ms:.2f}" for part, ms in parts.items())
            print(f"  {num_running} running: {median_ms:.3f} ms (mean ms a step: {breakdown})")
        long_model = build(
            {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 16384},
            Path(tmp) / "long-context", architecture="LlamaForCausalLM",
        )  # fmt: skip
        print("3. host time per step outside the forward of one request (logprobs 5, a stop string), by output length:")
        for length, cost_us in output_cost_by_length(long_model).items():
            print(f"  {length:5d} tokens: {cost_us:.0f} us")
        windows = server_cpu_by_window(long_model, args.repo)
        print("4. server HTTP-thread CPU per 1,000 streamed tokens (the same request over HTTP), window by window:")
        print("  " + ", ".join(f"{seconds * 1e3:.0f} ms" for seconds in windows))


if __name__ == "__main__":
    main()
