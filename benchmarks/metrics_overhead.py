"""What metrics cost the engine loop: the stats work per step next to the model step itself.

Drives `LLMEngine` the way the async engine's thread does and times, for every step, the model
step and then everything the engine thread does for metrics: `StatsTracker.stepped` + `collect`
and `ServerMetrics.record_step` (the Prometheus updates). Also times one /metrics exposition,
which runs on the HTTP thread, not the engine's.

    .venv/bin/python -m benchmarks.metrics_overhead [--num-requests 64 256] [--max-tokens 64]
"""

import argparse
import random
import statistics
import time

from benchmarks.harness import random_tokens
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.stats import StatsTracker
from kvserve.server.metrics import ServerMetrics


def run(num_requests: int, max_tokens: int) -> dict:
    engine = LLM(max_num_seqs=num_requests).engine  # the built-in default model
    tracker, metrics = StatsTracker(), ServerMetrics("bench")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    now_s = time.monotonic()
    for _ in range(num_requests):
        prompt = random_tokens(rng, engine.core.vocab_size, rng.randint(32, 128))
        request_id = engine.add_request(prompt, params)
        tracker.arrived(request_id, len(prompt), now_s)
    step_s, stats_s = [], []
    while engine.has_unfinished():
        start_s = time.perf_counter()
        result = engine.core.step()
        engine.process(result)
        end_s = time.perf_counter()
        tracker.stepped(result, start_s, end_s)
        metrics.record_step(tracker.collect(engine.core.queue_stats()))
        step_s.append(end_s - start_s)
        stats_s.append(time.perf_counter() - end_s)
    start_s = time.perf_counter()
    exposition = metrics.exposition()
    return {
        "requests": num_requests,
        "steps": len(step_s),
        "step_ms_median": statistics.median(step_s) * 1e3,
        "stats_us_median": statistics.median(stats_s) * 1e6,
        "stats_us_max": max(stats_s) * 1e6,
        "stats_share_of_loop": sum(stats_s) / (sum(step_s) + sum(stats_s)),
        "exposition_ms": (time.perf_counter() - start_s) * 1e3,
        "exposition_bytes": len(exposition),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    for num_requests in args.num_requests:
        result = run(num_requests, args.max_tokens)
        print(
            f"{result['requests']:4d} requests, {result['steps']} steps: model step median "
            f"{result['step_ms_median']:.2f} ms; stats + Prometheus per step median "
            f"{result['stats_us_median']:.0f} µs, max {result['stats_us_max']:.0f} µs; share of the loop "
            f"{result['stats_share_of_loop']:.2%}; /metrics exposition {result['exposition_ms']:.2f} ms "
            f"({result['exposition_bytes']} bytes)"
        )


if __name__ == "__main__":
    main()
