"""The `--json` file: the settings, every summary figure, the time series and one record per request."""

import json
from dataclasses import asdict
from pathlib import Path

from kvserve.server.bench.client import RequestRecord
from kvserve.server.bench.config import BenchConfig
from kvserve.server.bench.runner import BenchRun
from kvserve.server.bench.summary import Summary, output_tokens_per_second


def write_json(path: Path, config: BenchConfig, summary: Summary, run: BenchRun) -> None:
    document = {
        "config": config.public_dict(),
        "summary": asdict(summary),
        "output_tokens_per_s": output_tokens_per_second(run.records, run.duration_s),  # 1 s bins from the start
        "kv_cache_usage": [{"time_s": time_s, "ratio": ratio} for time_s, ratio in run.kv_usage],
        "requests": [_record(record) for record in run.records],
    }
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


def _record(record: RequestRecord) -> dict:
    return {
        "index": record.index, "success": record.success, "error": record.error, "output_len": record.output_len,
        "prompt_tokens": record.prompt_tokens, "output_tokens": record.output_tokens, "start_s": record.start_s,
        "end_s": record.end_s, "ttft_s": record.ttft_s, "tpot_s": record.tpot_s, "e2el_s": record.e2el_s,
        "itl_s": record.itl_s,
    }  # fmt: skip
