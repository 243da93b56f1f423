"""`kvserve bench`: its flags (named as `vllm bench serve` names them where it has one) and the run from them."""

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from kvserve.server.bench.client import list_models
from kvserve.server.bench.config import BenchConfig, auth_headers
from kvserve.server.bench.endpoints import ENDPOINT_PATHS
from kvserve.server.bench.errors import BenchError
from kvserve.server.bench.report import write_report
from kvserve.server.bench.results import write_json
from kvserve.server.bench.runner import BenchRun, http_client, run_benchmark
from kvserve.server.bench.summary import Summary, format_table, summarize
from kvserve.server.bench.workload import BenchRequest, file_requests, random_requests

DESCRIPTION = """Load-test an OpenAI-compatible server (kvserve or any other) with streamed requests and print
throughput and TTFT / TPOT / ITL / E2E latency percentiles, as `vllm bench serve` does. Token counts come from the
server's usage chunks (exact). Against kvserve the KV cache usage is scraped from /metrics for the report.

Exit status: 0 when every request succeeded; 1 when the target cannot be reached or refuses (bad URL, 401, 404),
the dataset or tokenizer cannot be read, or any request failed (the summary names the first error); 2 for bad
command-line arguments."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server and report throughput and latencies",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = bench.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1 (%(default)s)")
    target.add_argument("--model", help="model to ask for (default: the first id from GET /v1/models)")
    target.add_argument("--endpoint", type=_endpoint, default="completions", metavar="ENDPOINT",
                        help="completions, chat, responses or messages, or its path: /v1/completions, "
                             "/v1/chat/completions, /v1/responses (OpenAI's Responses), /v1/messages (Anthropic's) "
                             "(%(default)s)")  # fmt: skip
    target.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY, if set)")
    target.add_argument("--timeout-s", type=_positive(float), default=300.0,
                        help="give up on a request after this many seconds (%(default)s)")  # fmt: skip

    workload = bench.add_argument_group("workload")
    workload.add_argument("--num-prompts", type=_positive(int), default=100, help="requests to send (%(default)s)")
    workload.add_argument("--dataset", "--dataset-name", choices=("random", "file"), default="random",
                          help="random prompts, or prompts from --dataset-path (%(default)s)")  # fmt: skip
    workload.add_argument("--dataset-path",
                          help='.txt: a prompt a line; .jsonl: {"prompt": ...} a line (reused as needed)')  # fmt: skip
    workload.add_argument("--random-input-len", type=_positive(int), default=256,
                          help="prompt tokens: exact with --tokenizer, else words (%(default)s)")  # fmt: skip
    workload.add_argument("--random-output-len", "--max-tokens", dest="output_len", metavar="LEN", default=128,
                          type=_positive(int),
                          help="max_tokens of each request, exact with --ignore-eos (%(default)s)")  # fmt: skip
    workload.add_argument("--random-range-ratio", type=_ratio, default=0.0,
                          help="draw lengths uniformly from len * [1 - r, 1 + r] (%(default)s)")  # fmt: skip
    workload.add_argument("--tokenizer", help="HF tokenizer dir (tokenizer.json): prompts of exactly the input length")
    workload.add_argument("--ignore-eos", action="store_true", help="generate max_tokens tokens even past EOS")
    workload.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (%(default)s)")
    workload.add_argument("--seed", type=int, default=0, help="seeds the prompts, lengths and arrivals (%(default)s)")

    pacing = bench.add_argument_group("pacing")
    pacing.add_argument("--request-rate", type=_positive(float), default=float("inf"),
                        help="requests per second, Poisson arrivals (default inf: all at once)")  # fmt: skip
    pacing.add_argument("--max-concurrency", type=_positive(int),
                        help="at most this many requests in flight (default: no limit)")  # fmt: skip

    output = bench.add_argument_group("output")
    output.add_argument("--json", type=Path, help="write every figure and the per-request records here")
    output.add_argument("--report", type=_html_path,
                        help="write an HTML report: TTFT, ITL histograms; tokens/s, KV usage over time")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.dataset == "file" and args.dataset_path is None:
        print("error: --dataset file needs --dataset-path", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request on the console
    try:
        return asyncio.run(_bench(args))
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130  # the shell's status for SIGINT


async def _bench(args: argparse.Namespace) -> int:
    requests = _requests(args)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    async with http_client(args.timeout_s) as client:
        served = await list_models(client, base_url, auth_headers(api_key))
        config = BenchConfig(
            base_url=base_url, model=args.model or served[0], endpoint=args.endpoint, api_key=api_key,
            ignore_eos=args.ignore_eos, temperature=args.temperature, request_rate=args.request_rate,
            max_concurrency=args.max_concurrency, timeout_s=args.timeout_s, seed=args.seed,
        )  # fmt: skip
        concurrency = config.max_concurrency or "unlimited"
        print(f"{len(requests)} requests to {config.request_url} (model {config.model}), "
              f"rate {config.request_rate:g}/s, concurrency {concurrency}", flush=True)  # fmt: skip
        run = await run_benchmark(client, config, requests)
    summary = summarize(run)
    if summary.completed:
        print(format_table(summary, config))
    _write_files(args, config, summary, run)  # also when requests failed: the records say how
    if summary.completed == 0:
        raise BenchError(f"all {summary.failed} requests failed; the first: {summary.first_error}")
    if summary.failed:
        print(f"error: {summary.failed} of {len(requests)} requests failed; the first: {summary.first_error}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset == "file":
        return file_requests(args.dataset_path, args.num_prompts, args.output_len, args.random_range_ratio, args.seed)
    return random_requests(args.num_prompts, args.random_input_len, args.output_len, args.random_range_ratio,
                           args.seed, args.tokenizer)  # fmt: skip


def _write_files(args: argparse.Namespace, config: BenchConfig, summary: Summary, run: BenchRun) -> None:
    try:
        if args.json is not None:
            write_json(args.json, config, summary, run)
            print(f"wrote {args.json}")
        if args.report is not None:
            write_report(args.report, config, summary, run)
            print(f"wrote {args.report}")
    except OSError as error:
        raise BenchError(f"cannot write results: {error}") from error


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse


def _endpoint(text: str) -> str:
    """An endpoint's name, or its path (as vllm bench serve's --endpoint takes it)."""
    by_path = {path: name for name, path in ENDPOINT_PATHS.items()}
    name = by_path.get(text, text)
    if name not in ENDPOINT_PATHS:
        raise argparse.ArgumentTypeError(f"one of {', '.join(ENDPOINT_PATHS)} or their paths, not {text}")
    return name


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), not {text}")
    return value


def _html_path(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() not in (".html", ".htm"):
        raise argparse.ArgumentTypeError(f"the report is an HTML file (.html), not {text}")
    return path
