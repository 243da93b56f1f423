"""The figures of a run, defined as `vllm bench serve` defines them, and the table that prints them.

Over the successful requests: TTFT (send to first generated chunk), TPOT ((E2EL - TTFT) / (output tokens - 1),
requests of two tokens or more), ITL (every gap between chunks, pooled), E2EL (send to end of stream);
percentiles interpolate linearly between order statistics, as numpy's default does.
"""

import math
import statistics
from dataclasses import dataclass

from kvserve.server.bench.client import RequestRecord
from kvserve.server.bench.config import BenchConfig
from kvserve.server.bench.runner import BenchRun

TABLE_WIDTH = 50
LABEL_WIDTH = 40


@dataclass(frozen=True)
class Distribution:
    count: int
    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def of(cls, values_s: list[float]) -> "Distribution | None":
        if not values_s:
            return None
        ordered_ms = sorted(value * 1e3 for value in values_s)
        return cls(
            count=len(ordered_ms), mean_ms=statistics.fmean(ordered_ms), median_ms=percentile(ordered_ms, 50),
            p90_ms=percentile(ordered_ms, 90), p99_ms=percentile(ordered_ms, 99),
        )  # fmt: skip


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    peak_output_tokens_per_s: float  # the busiest 1 s bin
    total_tokens_per_s: float
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2el: Distribution | None
    first_error: str | None


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile of sorted values, interpolated linearly (numpy's default method)."""
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(run: BenchRun) -> Summary:
    done = [record for record in run.records if record.success]
    failed = [record for record in run.records if not record.success]
    input_tokens = sum(record.prompt_tokens for record in done)
    output_tokens = sum(record.output_tokens for record in done)
    return Summary(
        completed=len(done), failed=len(failed), duration_s=run.duration_s, total_input_tokens=input_tokens,
        total_output_tokens=output_tokens, requests_per_s=len(done) / run.duration_s,
        output_tokens_per_s=output_tokens / run.duration_s,
        peak_output_tokens_per_s=max(output_tokens_per_second(run.records, run.duration_s), default=0.0),
        total_tokens_per_s=(input_tokens + output_tokens) / run.duration_s,
        ttft=Distribution.of([record.ttft_s for record in done if record.ttft_s is not None]),
        tpot=Distribution.of([record.tpot_s for record in done if record.tpot_s is not None]),
        itl=Distribution.of([gap for record in done for gap in record.itl_s]),
        e2el=Distribution.of([record.e2el_s for record in done]),
        first_error=min(failed, key=lambda record: record.start_s).error if failed else None,
    )  # fmt: skip


def output_tokens_per_second(records: tuple[RequestRecord, ...], duration_s: float) -> list[float]:
    """Output tokens in each 1 s bin of the run. A request's tokens are spread evenly over its chunks: the
    usage gives the exact total, and a chunk may hold more than one token."""
    bins = [0.0] * max(1, math.ceil(duration_s))
    for record in records:
        if not record.success:
            continue
        tokens_per_chunk = record.output_tokens / len(record.chunk_times_s)
        for time_s in record.chunk_times_s:
            bins[min(int(time_s), len(bins) - 1)] += tokens_per_chunk
    return bins


def summary_rows(summary: Summary, config: BenchConfig) -> list[tuple[str, str | None]]:
    """(label, value) pairs, and a heading (value None) before each latency figure; shared by the printed table
    and the HTML report."""
    rows: list[tuple[str, str | None]] = [
        ("Successful requests", f"{summary.completed}"),
        ("Failed requests", f"{summary.failed}"),
        ("Maximum request concurrency", f"{config.max_concurrency or 'unlimited'}"),
        ("Request rate (req/s)", f"{config.request_rate:g}"),
        ("Benchmark duration (s)", f"{summary.duration_s:.2f}"),
        ("Total input tokens", f"{summary.total_input_tokens}"),
        ("Total generated tokens", f"{summary.total_output_tokens}"),
        ("Request throughput (req/s)", f"{summary.requests_per_s:.2f}"),
        ("Output token throughput (tok/s)", f"{summary.output_tokens_per_s:.2f}"),
        ("Peak output token throughput (tok/s)", f"{summary.peak_output_tokens_per_s:.2f}"),
        ("Total token throughput (tok/s)", f"{summary.total_tokens_per_s:.2f}"),
    ]
    figures = [("Time to First Token", "TTFT", summary.ttft),
               ("Time per Output Token (excl. 1st token)", "TPOT", summary.tpot),
               ("Inter-token Latency", "ITL", summary.itl), ("End-to-end Latency", "E2EL", summary.e2el)]  # fmt: skip
    for heading, short, distribution in figures:
        rows.append((heading, None))
        if distribution is None:
            rows.append((f"{short} (ms)", "-"))
            continue
        rows += [(f"Mean {short} (ms)", f"{distribution.mean_ms:.2f}"),
                 (f"Median {short} (ms)", f"{distribution.median_ms:.2f}"),
                 (f"P90 {short} (ms)", f"{distribution.p90_ms:.2f}"),
                 (f"P99 {short} (ms)", f"{distribution.p99_ms:.2f}")]  # fmt: skip
    return rows


def format_table(summary: Summary, config: BenchConfig) -> str:
    lines = [" Serving Benchmark Result ".center(TABLE_WIDTH, "=")]
    for label, value in summary_rows(summary, config):
        lines.append(f" {label} ".center(TABLE_WIDTH, "-") if value is None else f"{label + ':':<{LABEL_WIDTH}}{value}")
    if summary.first_error is not None:
        lines.append(f"First error: {summary.first_error}")
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)
