"""`kvserve bench` run as a process against a real server on loopback: its counts agree with the server's own
counters, it writes its JSON and HTML, and it fails with one clear line (exit status 1) when the target is wrong."""

import itertools
import json
import math
import os
import socket
import subprocess
import sys

import httpx
import numpy as np
import pytest

from kvserve.server.bench.arrivals import arrival_times_s
from kvserve.server.bench.kv_scraper import parse_kv_usage
from kvserve.server.bench.summary import percentile
from tests.server_harness import TINY_MODEL, slow_down_steps, tiny_server

BENCH_TIMEOUT_S = 120


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-P", "-m", "kvserve.server.cli", "bench", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S, env=env)


def counters(server) -> tuple[float, float]:
    server.wait_until_idle()
    return server.metric("prompt_tokens_total"), server.metric("generation_tokens_total")


def test_token_totals_are_exact_and_match_the_servers_counters(server, tiny_checkpoints, tmp_path, monkeypatch):
    slow_down_steps(server, monkeypatch)  # the run lasts over a second, so /metrics is scraped mid-run
    prompt_before, generated_before = counters(server)
    result = bench(
        "--base-url", server.base_url, "--num-prompts", "12", "--random-input-len", "24", "--random-output-len", "48",
        "--ignore-eos", "--tokenizer", str(tiny_checkpoints["llama"]), "--max-concurrency", "4",
        "--json", str(tmp_path / "result.json"), "--report", str(tmp_path / "report.html"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    prompt_after, generated_after = counters(server)

    document = json.loads((tmp_path / "result.json").read_text())
    summary = document["summary"]
    assert (summary["completed"], summary["failed"]) == (12, 0)
    assert summary["total_output_tokens"] == 12 * 48 == generated_after - generated_before
    # With the tokenizer each prompt is exactly --random-input-len tokens, as the server counts them.
    assert summary["total_input_tokens"] == 12 * 24 == prompt_after - prompt_before
    assert document["config"]["model"] == TINY_MODEL
    assert [record["index"] for record in document["requests"]] == list(range(12))
    assert all(record["success"] and record["output_tokens"] == 48 for record in document["requests"])
    assert all(len(record["itl_s"]) >= 1 for record in document["requests"])
    assert summary["ttft"]["count"] == 12 and summary["itl"]["median_ms"] > 0
    assert any(sample["ratio"] > 0 for sample in document["kv_cache_usage"])
    assert "Successful requests:                    12" in result.stdout

    report = (tmp_path / "report.html").read_text()
    assert report.count("<svg") == 4
    for title in ("Time to first token", "Inter-token latency", "Output tokens per second", "KV cache usage"):
        assert f"<title>{title}</title>" in report
    assert not any(tag in report for tag in ("<script", "<link", "src=")), "the report is one self-contained file"


@pytest.mark.parametrize(("endpoint", "file_name", "content"), [
    ("chat", "prompts.jsonl", '{"prompt": "What is a token?"}\n{"prompt": "Tell me about caches."}\n'),
    ("completions", "prompts.txt", "Once upon a time\n\nThe cache is cut into blocks\nwhat is a token\n"),
    ("/v1/responses", "prompts.txt", "Once upon a time\nwhat is a token\n"),
    ("/v1/messages", "prompts.txt", "Once upon a time\nwhat is a token\n"),
], ids=["chat-jsonl", "completions-txt", "responses-txt", "messages-txt"])  # fmt: skip
def test_file_prompts_on_either_endpoint(server, tmp_path, endpoint, file_name, content):
    (tmp_path / file_name).write_text(content)
    prompt_before, generated_before = counters(server)
    result = bench(
        "--base-url", server.base_url, "--endpoint", endpoint, "--dataset", "file",
        "--dataset-path", str(tmp_path / file_name), "--num-prompts", "5", "--max-tokens", "6", "--ignore-eos",
        "--json", str(tmp_path / "result.json"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    prompt_after, generated_after = counters(server)
    summary = json.loads((tmp_path / "result.json").read_text())["summary"]
    assert summary["completed"] == 5
    assert summary["total_output_tokens"] == 5 * 6 == generated_after - generated_before
    assert summary["total_input_tokens"] == prompt_after - prompt_before > 0


def test_max_concurrency_one_never_has_two_requests_in_flight(server, tmp_path):
    result = bench(
        "--base-url", server.base_url, "--num-prompts", "6", "--random-input-len", "8", "--max-tokens", "4",
        "--ignore-eos", "--max-concurrency", "1", "--json", str(tmp_path / "result.json"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = sorted(json.loads((tmp_path / "result.json").read_text())["requests"], key=lambda r: r["start_s"])
    assert len(records) == 6
    for earlier, later in itertools.pairwise(records):
        assert later["start_s"] >= earlier["end_s"]


def test_some_requests_failing_shows_the_count_and_first_error_and_exits_1(server, tmp_path):
    # One prompt longer than the tiny model's 512-token context: the server refuses it with a 400.
    (tmp_path / "prompts.txt").write_text("a short prompt\n" + "word " * 600 + "\nanother short prompt\n")
    result = bench("--base-url", server.base_url, "--dataset", "file", "--dataset-path", str(tmp_path / "prompts.txt"),
                   "--num-prompts", "3", "--max-tokens", "2", "--max-concurrency", "1")  # fmt: skip
    assert result.returncode == 1
    assert "Successful requests:                    2" in result.stdout
    assert "Failed requests:                        1" in result.stdout
    assert result.stderr.startswith("error: 1 of 3 requests failed; the first: HTTP 400: the prompt has ")


def test_a_closed_port_is_one_clear_line_and_exit_1():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again when the block ends: nothing listens there
    result = bench("--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2")
    assert result.returncode == 1
    assert result.stderr == f"error: cannot connect to http://127.0.0.1:{port}/v1/models: connection refused\n"
    assert result.stdout == ""


def test_a_wrong_model_names_the_servers_message_and_exits_1(server):
    refusal = httpx.post(f"{server.base_url}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    message = refusal.json()["error"]["message"]
    result = bench("--base-url", server.base_url, "--model", "nope", "--num-prompts", "3")
    assert result.returncode == 1
    assert result.stderr == f"error: all 3 requests failed; the first: HTTP 404: {message}\n"


def test_a_missing_api_key_is_the_401_message_and_the_env_key_is_used(tiny_checkpoints):
    with tiny_server(tiny_checkpoints, api_key="sekrit") as secured:
        env_without_key = {name: value for name, value in os.environ.items() if name != "OPENAI_API_KEY"}
        refused = bench("--base-url", secured.base_url, "--num-prompts", "2", env=env_without_key)
        accepted = bench("--base-url", f"{secured.base_url}/v1", "--num-prompts", "2", "--random-input-len", "8",
                         "--max-tokens", "2",
                         env={**env_without_key, "OPENAI_API_KEY": "sekrit"})  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr == (f"error: {secured.base_url}/v1/models answered HTTP 401: missing or invalid API key\n")
    assert accepted.returncode == 0, accepted.stderr


def test_the_bench_imports_neither_the_engine_nor_torch():
    code = "import sys, kvserve.server.cli\nassert not {'torch', 'kvserve.engine'} & set(sys.modules), 'imported'\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_percentiles_are_numpys_linear_ones():
    values = sorted(np.random.default_rng(0).exponential(size=101).tolist())
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([3.0], 99) == 3.0


def test_poisson_arrivals_are_seeded_with_the_requested_mean_rate():
    times_s = arrival_times_s(4000, request_rate=20.0, seed=1)
    assert times_s[0] == 0.0 and times_s == sorted(times_s)
    assert times_s == arrival_times_s(4000, request_rate=20.0, seed=1)
    assert times_s[-1] / (len(times_s) - 1) == pytest.approx(1 / 20, rel=0.05)
    assert arrival_times_s(3, request_rate=math.inf, seed=1) == [0.0, 0.0, 0.0]


def test_kv_usage_is_read_from_kvserves_metric_only():
    kvserve = (
        '# TYPE kvserve:kv_cache_usage_ratio gauge\nkvserve:kv_cache_usage_ratio_other 0.9\n'
        'kvserve:kv_cache_usage_ratio{model_name="m"} 0.25\n'
    )  # fmt: skip
    assert parse_kv_usage(kvserve) == 0.25
    assert parse_kv_usage('vllm:kv_cache_usage_perc{model_name="m"} 0.5\n') is None
    assert parse_kv_usage("<html>not found</html>") is None


def test_the_report_path_must_be_html(tmp_path):
    result = bench("--report", str(tmp_path / "report.png"))
    assert result.returncode == 2
    assert "the report is an HTML file (.html)" in result.stderr


def test_an_unreadable_prompt_file_is_one_clear_line_and_exit_1(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "fine"}\n{"text": "no prompt field"}\n')
    missing = bench("--dataset", "file", "--dataset-path", str(tmp_path / "missing.txt"))
    malformed = bench("--dataset", "file", "--dataset-path", str(tmp_path / "prompts.jsonl"))
    assert missing.returncode == malformed.returncode == 1
    assert missing.stderr.startswith(f"error: cannot read prompts from {tmp_path / 'missing.txt'}: ")
    assert malformed.stderr == f'error: {tmp_path / "prompts.jsonl"}:2: no "prompt" string\n'


def test_a_request_the_server_dropped_unanswered_is_sent_again_once(tmp_path):
    """A server that closes the first connection of each pair without answering (as a server dropping a kept-alive
    connection does): every request still completes, each sent at most twice, and the run exits 0."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    arrivals = itertools.count()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:  # /v1/models and the KV scraper's /metrics
            body = json.dumps({"data": [{"id": "m"}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            if next(arrivals) % 2 == 0:
                self.close_connection = True  # drop it, unanswered
                return
            chunks = [
                {"choices": [{"index": 0, "text": "x"}]},
                {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
            ]
            body = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "run.json"
        done = bench("--base-url", f"http://127.0.0.1:{server.server_port}", "--num-prompts", "3", "--random-input-len",
                     "4", "--random-output-len", "1", "--max-concurrency", "1", "--json", str(out))  # fmt: skip
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(out.read_text())["summary"]["completed"] == 3
    assert next(arrivals) == 6  # each of the 3 requests: dropped once, answered once
