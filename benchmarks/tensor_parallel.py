"""Tensor parallelism, N=1 against N=2: throughput, and what the ranks exchange (issue 14; a benchmark, not a
timed test).

    .venv/bin/python -m benchmarks.tensor_parallel                    # 64 requests, 3 rounds
    .venv/bin/python -m benchmarks.tensor_parallel --num-requests 24  # BENCHMARKS.md's CPU run
    python3 -m benchmarks.tensor_parallel --device cuda --quick --rounds 1  # gpu_check.sh, 2 GPUs

offline_throughput.py's model (Qwen3-shaped, hidden 512, 8 layers, 32k vocabulary, random weights) and its
workload generator: every request submitted at once, greedy, each output to its length. The rounds alternate
N=1, N=2, N=1, ...; every run is a process of its own, because `LLM(..., tensor_parallel_size=2)` sets this
process's torch threads to cores // 2 (which would carry over into a later N=1 run) and because a fresh process
starts both from the same cold state (allocator, oneDNN caches, no process group left behind).

On rank 0 (the run's process; the rank it spawns imports the class afresh and is not counted) the group's
collectives are wrapped with counters of tensor bytes and perf_counter time: the all-reduces of the layers and
of the embedding, the gather of the LM head's fp32 logits, and the broadcasts of each step's message. The
bytes are also computed from the model's shape and each step's message, as a check on the counters. Time in
a collective on rank 0 is skew + transfer: it includes waiting for the slower rank to arrive, so it is not
the link's bandwidth. On CUDA the wrappers synchronise the device around each call (otherwise they would
time a kernel launch), which serialises the step: its time there is not the engine's. Both N run eagerly on
CUDA (tensor-parallel steps do not replay CUDA graphs yet), so they compare like for like.

On a 2-core machine N=2 runs two ranks of one thread each where N=1 runs one process of two threads, so N=2
cannot beat N=1 (BENCHMARKS.md: 0.37x): the point here is that the split engine runs (same greedy tokens) and
what its communication costs. Printed: one line per run, then a markdown table with the ratios N=2 / N=1.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import Qwen3Config

from benchmarks.checkpoints import qwen3_50m_dir
from benchmarks.harness import random_workload
from benchmarks.processes import OthersLoad, child_cwd, child_env, command_line
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.engine.step_plan import StepPlan

KV_CACHE_BYTES = 2 << 30  # as offline_throughput.py (each rank's budget)
COLLECTIVES = ("all_reduce", "gather_on_first", "broadcast_from_first")


@dataclass
class Counter:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class StepShape:
    """What one step plan says about the step: the shape the communication follows from."""

    num_tokens: int
    num_logit_rows: int
    message_bytes: int


def moved_bytes(name: str, group: TensorParallelGroup, tensor: torch.Tensor) -> int:
    """Tensor bytes a collective moves, as rank 0 sees it: the all-reduced tensor, the other ranks' parts it
    gathers, the host tensor it broadcasts."""
    if name == "gather_on_first":
        return (group.size - 1) * tensor.nbytes
    return tensor.nbytes


def timed(name: str, original, counters: dict[str, Counter]):
    """`original` (a collective of the group) counting its calls, bytes and time in `counters[name]`."""

    def collective(group: TensorParallelGroup, tensor: torch.Tensor, *args, **kwargs):
        if tensor.is_cuda:  # time the collective, not its launch (and not the kernels queued before it)
            torch.cuda.synchronize(tensor.device)
        start_s = time.perf_counter()
        result = original(group, tensor, *args, **kwargs)
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        counter = counters[name]
        counter.seconds += time.perf_counter() - start_s
        counter.calls += 1
        counter.bytes += moved_bytes(name, group, tensor)
        return result

    return collective


def count_collectives(counters: dict[str, Counter], steps: list[StepShape]) -> None:
    """Wrap the group's collectives and the step plan's send in this process with counters."""
    for name in COLLECTIVES:
        setattr(TensorParallelGroup, name, timed(name, getattr(TensorParallelGroup, name), counters))
    send = StepPlan.send

    def counted_send(plan: StepPlan, group: TensorParallelGroup) -> None:
        steps.append(StepShape(plan.num_tokens, len(plan.logit_rows), plan.nbytes))
        send(plan, group)

    StepPlan.send = counted_send


def computed_bytes(llm: LLM, steps: list[StepShape]) -> dict[str, int]:
    """Bytes the steps move by the model's shape: per layer two all-reduces of [tokens, hidden] in the model's
    dtype (attention's o_proj, the MLP's down_proj) plus the embedding's; [rows, vocab / N] fp32 logits from
    each other rank; the step plan."""
    model, size = llm.engine.core.model, llm.engine.config.tensor_parallel_size
    if size == 1:
        return {name: 0 for name in COLLECTIVES}
    row_bytes = model.config.hidden_size * next(model.parameters()).dtype.itemsize
    all_reduces_per_step = 2 * model.config.num_layers + 1
    return {
        "all_reduce": sum(step.num_tokens * row_bytes * all_reduces_per_step for step in steps),
        "gather_on_first": sum((size - 1) * step.num_logit_rows * model.plan.vocab_rows * 4 for step in steps),
        "broadcast_from_first": sum(step.message_bytes for step in steps),
    }


def run_once(args: argparse.Namespace, size: int) -> dict:
    """One engine with `size` ranks over the whole workload, timed per step on rank 0."""
    counters, steps = {name: Counter() for name in COLLECTIVES}, []
    count_collectives(counters, steps)
    prompts, output_lens = workload(args)
    cuda = args.device == "cuda"
    with LLM(
        str(qwen3_50m_dir()), tensor_parallel_size=size, device=args.device, max_num_seqs=len(prompts),
        dtype="bfloat16" if cuda else "float32", kv_cache_memory_bytes=KV_CACHE_BYTES, enforce_eager=cuda,
    ) as llm:  # fmt: skip
        # A short warm-up (first-use allocations and weight packing), then the counters start from zero.
        llm.generate([[5] * 24], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        counters.update({name: Counter() for name in COLLECTIVES})
        steps.clear()
        engine = llm.engine
        request_ids = [
            engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
            for prompt, output_len in zip(prompts, output_lens, strict=True)
        ]
        outputs: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
        step_s = []
        while engine.has_unfinished():
            start_s = time.perf_counter()
            deltas = engine.step()
            step_s.append(time.perf_counter() - start_s)
            for delta in deltas:
                outputs[delta.request_id].extend(delta.token_ids)
        return {
            "size": size,
            "threads": torch.get_num_threads(),
            "elapsed_s": sum(step_s),
            "num_tokens": sum(map(len, outputs.values())),
            "steps": len(step_s),
            "messages": len(steps),
            "measured": {name: asdict(counter) for name, counter in counters.items()},
            "computed": computed_bytes(llm, steps),
            "outputs": [outputs[request_id] for request_id in request_ids],
        }


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """offline_throughput.py's workload (its --quick one with --quick)."""
    prompt_range, output_range = ((8, 64), (4, 32)) if args.quick else ((32, 512), (16, 512))
    num_requests = 8 if args.quick else args.num_requests
    vocab_size = Qwen3Config.from_pretrained(qwen3_50m_dir()).vocab_size
    return random_workload(num_requests, vocab_size, prompt_range, output_range, seed=0)


def run_process(args: argparse.Namespace, size: int) -> dict:
    """`run_once` in a fresh process, with the cores other processes kept busy meanwhile."""
    others = OthersLoad()
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "result.json"
        command = [sys.executable, "-m", __spec__.name, *sys.argv[1:], "--one", str(size), "--out", str(out_file)]
        done = subprocess.run(command, env=child_env(), cwd=child_cwd(), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"N={size} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(out_file.read_text())
    wall_s, others_cores = others.measure()
    return {**result, "wall_s": wall_s, "others_cores": others_cores}


def per_step(run: dict, name: str, key: str) -> float:
    return run["measured"][name][key] / run["steps"]


def summarise(runs: dict[int, list[dict]]) -> None:
    """Medians over each N's rounds, as a markdown table with N=2 / N=1 where both ran."""
    sizes = sorted(runs)

    def median(size: int, value) -> float:
        return statistics.median(value(run) for run in runs[size])

    rows: list[tuple[str, list[float | None], str]] = []

    def row(label: str, value, fmt: str = "{:.2f}", comm_only: bool = False) -> None:
        rows.append((label, [None if comm_only and size == 1 else median(size, value) for size in sizes], fmt))

    row("output tok/s (median)", lambda run: run["num_tokens"] / run["elapsed_s"], "{:.1f}")
    row("steps", lambda run: run["steps"], "{:.0f}")
    row("step time, ms (mean)", lambda run: 1e3 * run["elapsed_s"] / run["steps"])
    row("all-reduce calls per step", lambda run: per_step(run, "all_reduce", "calls"), comm_only=True)
    row("all-reduce ms per step (rank 0)", lambda run: 1e3 * per_step(run, "all_reduce", "seconds"), comm_only=True)
    row("all-reduce share of step time", lambda run: share(run, ("all_reduce",)), "{:.1%}", comm_only=True)
    row("logits gather ms per step", lambda run: 1e3 * per_step(run, "gather_on_first", "seconds"), comm_only=True)
    row("step plan ms per step", lambda run: 1e3 * per_step(run, "broadcast_from_first", "seconds"),
        comm_only=True)  # fmt: skip
    row("all communication share", lambda run: share(run, COLLECTIVES), "{:.1%}", comm_only=True)
    labels = {"all_reduce": "all-reduce", "gather_on_first": "logits gather", "broadcast_from_first": "step plan"}
    for name, label in labels.items():
        row(f"{label} kB/step, computed", lambda run, name=name: run["computed"][name] / run["steps"] / 1e3,
            "{:.1f}", comm_only=True)  # fmt: skip
        row(f"{label} kB/step, measured", lambda run, name=name: per_step(run, name, "bytes") / 1e3, "{:.1f}",
            comm_only=True)  # fmt: skip

    print("\n| | " + " | ".join(f"N={size}" for size in sizes) + (" | N=2 / N=1 |" if sizes == [1, 2] else " |"))
    print("|---" * (len(sizes) + 1 + (sizes == [1, 2])) + "|")
    for label, values, fmt in rows:
        cells = ["-" if value is None else fmt.format(value) for value in values]
        if sizes == [1, 2]:
            cells.append("-" if None in values or not values[0] else f"{values[1] / values[0]:.2f}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    for size in sizes:
        rounds = " / ".join(f"{run['num_tokens'] / run['elapsed_s']:.1f}" for run in runs[size])
        print(f"N={size} tok/s per round: {rounds}")


def share(run: dict, names: tuple[str, ...]) -> float:
    return sum(run["measured"][name]["seconds"] for name in names) / run["elapsed_s"]


def same_outputs(reference: dict, run: dict) -> int:
    """Requests whose greedy tokens equal `reference`'s."""
    return sum(a == b for a, b in zip(reference["outputs"], run["outputs"], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="offline_throughput.py's 8 short requests")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="runs per N, alternating; medians are reported")
    parser.add_argument("--sizes", default="1,2", help="tensor_parallel_size values to compare")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a single run, in a process of its own
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        args.out.write_text(json.dumps(run_once(args, args.one)))
        return

    qwen3_50m_dir()  # built once here, not by two runs at the same time
    prompts, output_lens = workload(args)
    print(f"command: {command_line(__spec__.name)}")
    print(
        f"model {qwen3_50m_dir().name} on {args.device}; {len(prompts)} requests, {sum(output_lens)} output "
        f"tokens; {args.rounds} alternating rounds, every run a process of its own"
    )
    sizes = [int(size) for size in args.sizes.split(",")]
    runs: dict[int, list[dict]] = {size: [] for size in sizes}
    for round_index in range(args.rounds):
        for size in sizes:
            run = run_process(args, size)
            runs[size].append(run)
            identical = same_outputs(runs[sizes[0]][0], run)
            print(
                f"round {round_index + 1} N={size}: {run['num_tokens'] / run['elapsed_s']:.1f} tok/s, "
                f"{run['steps']} steps, {run['threads']} thread(s) on rank 0, {run['wall_s']:.0f} s wall, "
                f"others {run['others_cores']:.1f} cores; greedy tokens as N={sizes[0]} round 1's in "
                f"{identical}/{len(run['outputs'])} requests",
                flush=True,
            )
            if run["num_tokens"] != sum(output_lens):
                print(f"  warning: {run['num_tokens']} tokens, expected {sum(output_lens)}")
            if size > 1 and run["messages"] != run["steps"]:
                print(f"  warning: {run['messages']} step plans for {run['steps']} steps")
    summarise(runs)


if __name__ == "__main__":
    main()
