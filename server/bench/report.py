"""The `--report` file: one self-contained HTML page (inline SVG, no scripts) with the summary and four plots."""

from datetime import UTC, datetime
from html import escape
from pathlib import Path

from kvserve.server.bench import svg
from kvserve.server.bench.config import BenchConfig
from kvserve.server.bench.kv_scraper import KV_USAGE_METRIC
from kvserve.server.bench.runner import BenchRun
from kvserve.server.bench.summary import Distribution, Summary, output_tokens_per_second, summary_rows

STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 720px; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
td { padding: 2px 12px 2px 0; } td.value { text-align: right; font-variant-numeric: tabular-nums; }
th { text-align: left; padding-top: 8px; }
figure { margin: 0 0 1.5em 0; }
"""


def write_report(path: Path, config: BenchConfig, summary: Summary, run: BenchRun) -> None:
    path.write_text(render_report(config, summary, run), encoding="utf-8")


def render_report(config: BenchConfig, summary: Summary, run: BenchRun) -> str:
    done = [record for record in run.records if record.success]
    ttft_ms = [record.ttft_s * 1e3 for record in done if record.ttft_s is not None]
    itl_ms = [gap * 1e3 for record in done for gap in record.itl_s]
    bins = output_tokens_per_second(run.records, run.duration_s)
    tokens_per_s = [(index + 0.5, tokens) for index, tokens in enumerate(bins)]  # each 1 s bin at its middle
    end_s = len(bins)  # the time axes end with the last bin, which the run may fill only in part
    figures = [
        svg.histogram(ttft_ms, "Time to first token", "TTFT (ms)", "requests", _markers(summary.ttft)),
        svg.histogram(itl_ms, "Inter-token latency", "ITL (ms)", "gaps between chunks", _markers(summary.itl)),
        svg.line_chart(tokens_per_s, "Output tokens per second", "time since start (s)", "tokens/s", end_s),
    ]
    if run.kv_usage:
        usage_percent = [(time_s, ratio * 100) for time_s, ratio in run.kv_usage]
        figures.append(
            svg.line_chart(usage_percent, "KV cache usage", "time since start (s)", "in use (%)", end_s, 100)
        )
    else:
        figures.append(f"<p>KV cache usage: not scraped ({escape(config.base_url)}/metrics has no "
                       f"{KV_USAGE_METRIC}; the target is not kvserve).</p>")  # fmt: skip
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    settings = ", ".join(f"{name} {value}" for name, value in config.public_dict().items())
    body = "\n".join([
        "<h1>kvserve bench</h1>",
        f"<p>{escape(config.model)} at {escape(config.request_url)}, {when}<br><small>{escape(settings)}</small></p>",
        _table(summary, config),
        *(f"<figure>{figure}</figure>" for figure in figures),
    ])  # fmt: skip
    head = f'<meta charset="utf-8"><title>kvserve bench: {escape(config.model)}</title><style>{STYLE}</style>'
    return f'<!doctype html>\n<html lang="en"><head>{head}</head>\n<body>\n{body}\n</body></html>\n'


def _markers(distribution: Distribution | None) -> dict[str, float]:
    if distribution is None:
        return {}
    return {"p50": distribution.median_ms, "p99": distribution.p99_ms}


def _table(summary: Summary, config: BenchConfig) -> str:
    rows = []
    for label, value in summary_rows(summary, config):
        if value is None:
            rows.append(f'<tr><th colspan="2">{escape(label)}</th></tr>')
        else:
            rows.append(f'<tr><td>{escape(label)}</td><td class="value">{escape(value)}</td></tr>')
    if summary.first_error is not None:
        rows.append(f"<tr><td>First error</td><td>{escape(summary.first_error)}</td></tr>")
    return "<table>\n" + "\n".join(rows) + "\n</table>"
