"""Host time of engine steps, part by part, in one process: what `benchmarks/step_overhead.py` runs for each
checkout it compares (this checkout, or an older one before the `kvserve` namespace, whose packages import as
`engine`, `scheduler`). Imports nothing of the benchmarks package, so it runs against either layout:

    python -P benchmarks/step_probe.py --layout kvserve --num-running 256            # this checkout
    PYTHONPATH=OLD python -P benchmarks/step_probe.py --layout old --num-running 256  # a checkout before it

It prints one JSON object: the median host ms per step outside the model (step wall time less the forward and the
logits), and the mean ms a step of each part it can time in that layout.

With `--model-stub` the forward and the logits are not computed: they return tensors of the right shapes made once.
On a CPU the real forward streams the weights and the KV cache through the caches, and every step's host work then
starts from cold caches; with the stub it runs on warm ones, as it does where the model runs on a GPU.
"""

import argparse
import importlib
import json
import statistics
import time

NUM_WARM_STEPS = 5
NUM_TIMED_STEPS = 40


class Timer:
    """Wraps methods (of an object or a module) and adds up the seconds spent in each, by part name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, part: str, owner, name: str) -> None:
        method = getattr(owner, name)
        self.seconds.setdefault(part, 0.0)

        def timed(*args, **kwargs):
            start_s = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start_s

        setattr(owner, name, timed)


def _prompt(index: int) -> list[int]:
    return [5 + (index * 7 + j) % 900 for j in range(32)]


def _stub(model) -> None:
    """The model's forward and logits answered with tensors made once (zeros; seeded random logits)."""
    import torch

    hidden = torch.zeros(8192, model.config.hidden_size)
    logits = torch.randn(8192, model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    model.forward = lambda input_ids, *args: hidden[: len(input_ids)]
    model.compute_logits = lambda rows, *args: logits[: len(rows)]


def run(layout: str, num_running: int, model_stub: bool = False) -> dict:
    # By name: the packages are `kvserve.engine` here and `engine` in a checkout before the namespace.
    package = "kvserve.engine" if layout == "kvserve" else "engine"
    engine_package = importlib.import_module(package)
    model_dir = importlib.import_module(f"{package}.default_model").default_model_dir()
    llm = engine_package.LLM(
        str(model_dir), max_num_seqs=num_running, max_num_batched_tokens=8192, kv_cache_memory_bytes=1 << 30
    )
    engine = llm.engine
    params = engine_package.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for index in range(num_running):
        engine.add_request(_prompt(index), params)
    # The step on the critical path: the core's alone (its outputs are detokenized elsewhere) where there is one.
    stepper = engine.core if layout == "kvserve" else engine
    model = stepper.model
    if model_stub:
        _stub(model)
    model_timer = Timer()
    model_timer.wrap("model", model, "forward")
    model_timer.wrap("model", model, "compute_logits")
    for _ in range(NUM_WARM_STEPS):  # prefills, then steady decoding
        engine.step()
    host_ms, wall_ms, outputs_ms = [], [], []
    for _ in range(NUM_TIMED_STEPS):
        model_timer.seconds["model"] = 0.0
        start_s = time.perf_counter()
        step = stepper.step()
        wall_s = time.perf_counter() - start_s
        wall_ms.append(wall_s * 1e3)
        host_ms.append((wall_s - model_timer.seconds["model"]) * 1e3)
        if layout == "kvserve":  # its outputs, as the server processes them (off the step's path)
            start_s = time.perf_counter()
            engine.process(step)
            outputs_ms.append((time.perf_counter() - start_s) * 1e3)
    result = {"layout": layout, "num_running": num_running, "host_ms": statistics.median(host_ms),
              "step_ms": statistics.median(wall_ms)}  # fmt: skip
    if outputs_ms:
        result["output_processing_ms"] = statistics.median(outputs_ms)
    result["parts_ms"] = _parts(layout, engine)
    return result


def _parts(layout: str, engine) -> dict[str, float]:
    """Mean ms a step of each timed part, over as many steps again (timing each part adds a little)."""
    timer = Timer()
    if layout == "kvserve":
        core = engine.core
        timer.wrap("scheduling", core.scheduler, "schedule")
        timer.wrap("planning the step", core.runner.planner, "plan")
        timer.wrap("writing the inputs", core.runner.worker.inputs, "prepare")
        timer.wrap("model", core.model, "forward")
        timer.wrap("model", core.model, "compute_logits")
        timer.wrap("sampling", importlib.import_module("kvserve.engine.core"), "sample")
        timer.wrap("recording the step", core.scheduler, "update")
        timer.wrap("core step", core, "step")
        for _ in range(NUM_TIMED_STEPS):
            core.step()
        core_total = timer.seconds.pop("core step")
        accounted = sum(timer.seconds.values())
        timer.seconds["the rest of the core step (its outputs, stop checks)"] = core_total - accounted
    else:
        timer.wrap("scheduling", engine.scheduler, "schedule")
        timer.wrap("writing the inputs", engine.runner.inputs, "prepare")
        timer.wrap("model", engine.model, "forward")
        timer.wrap("model", engine.model, "compute_logits")
        timer.wrap("sampling", importlib.import_module("engine.llm_engine"), "sample")
        timer.wrap("recording the step", engine.scheduler, "update")
        timer.wrap("detokenizing and stop checks", engine, "_process_token")
        for _ in range(NUM_TIMED_STEPS):
            engine.step()
    timer.seconds.pop("model")
    return {part: seconds * 1e3 / NUM_TIMED_STEPS for part, seconds in timer.seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("kvserve", "old"), default="kvserve")
    parser.add_argument("--num-running", type=int, default=256)
    parser.add_argument("--model-stub", action="store_true", help="no forward: the host's work on warm caches")
    args = parser.parse_args()
    print(json.dumps(run(args.layout, args.num_running, args.model_stub)))


if __name__ == "__main__":
    main()
