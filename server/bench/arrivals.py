"""When each request is sent: all at once, or Poisson arrivals at a mean rate, reproducible from the seed."""

import math
import random


def arrival_times_s(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times since the start: the first at 0, then exponential gaps of mean 1 / rate (a Poisson process,
    vLLM's default burstiness); an infinite rate sends every request at 0."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times_s = [0.0]
    for _ in range(num_requests - 1):
        times_s.append(times_s[-1] + rng.expovariate(request_rate))
    return times_s[:num_requests]
