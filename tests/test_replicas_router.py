"""Two `kvserve serve` replicas behind a real router from PyPI (vllm-router), on loopback: one is killed with
SIGKILL while streams run on both. Its clients get an error (not a hang, not a stream that looks finished), the
other replica's clients finish, the router stops sending to it, and a restart on the same port rejoins.

Slow (`make test-slow`): two servers, a router, seconds of streaming. Every process is bounded and killed at the
end."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server_process import KVSERVE, descendants, free_port

pytestmark = pytest.mark.slow

ROUTER = Path(sys.executable).with_name("vllm-router")
MODEL = "bench"
STARTUP_TIMEOUT_S = 120
HEALTH_CHECK_INTERVAL_S = 1
STREAM_TOKENS = 400  # a few seconds of decoding on the built-in model, so the kill lands mid-stream
NUM_STREAMS = 6
STREAM_TIMEOUT_S = 120


class Process:
    """A child process with its log, killed (with anything it started) by `stop` or on the way out."""

    def __init__(self, command: list[str], log_path: Path, cwd: Path) -> None:
        self.log_path = log_path
        with log_path.open("a") as log:
            self.popen = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        left = descendants(self.popen.pid) if self.popen.poll() is None else set()
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def start_replica(port: int, tmp_path: Path) -> Process:
    command = [KVSERVE, "serve", "--port", str(port), "--served-model-name", MODEL, "--no-console",
               "--kv-cache-memory-bytes", str(32 << 20)]  # fmt: skip
    replica = Process(command, tmp_path / f"replica-{port}.log", tmp_path)
    _wait(lambda: _status(f"http://127.0.0.1:{port}/health") == 200, replica, "the replica to start")
    return replica


def start_router(port: int, worker_ports: list[int], tmp_path: Path) -> Process:
    command = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
               "--worker-urls", *(f"http://127.0.0.1:{worker}" for worker in worker_ports),
               "--prometheus-port", str(free_port()), "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S),
               "--health-failure-threshold", "1", "--health-success-threshold", "1",
               "--worker-startup-timeout-secs", "60", "--log-level", "info"]  # fmt: skip
    router = Process(command, tmp_path / "router.log", tmp_path)
    _wait(lambda: _status(f"http://127.0.0.1:{port}/v1/models") == 200, router, "the router to start")
    return router


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def _wait(condition, process: Process, what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.popen.poll() is None, f"it exited waiting for {what}:\n{process.log()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{process.log()[-3000:]}"
        time.sleep(0.1)


def finished_requests(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvserve:requests_finished_total{"))  # fmt: skip


class Stream:
    """A streamed completion read on a thread: the chunks that carried text, whether `[DONE]` came, and the
    error (a transport error, a non-200, an SSE error event) if it ended otherwise."""

    def __init__(self, url: str) -> None:
        self.num_text_chunks, self.done, self.error = 0, False, None
        self.finish_reason = None
        body = {"model": MODEL, "prompt": "In the beginning", "max_tokens": STREAM_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=STREAM_TIMEOUT_S) as response:
                if response.status_code != 200:
                    self.error = f"status {response.status_code}"
                    return
                for line in response.iter_lines():
                    self._take(line)
        except httpx.HTTPError as error:
            self.error = f"{type(error).__name__}: {error}"

    def _take(self, line: str) -> None:
        if line == "data: [DONE]":
            self.done = True
        elif line.startswith("data: "):
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                self.error = chunk["error"]
            elif chunk["choices"]:
                self.num_text_chunks += 1
                self.finish_reason = chunk["choices"][0].get("finish_reason") or self.finish_reason

    @property
    def completed(self) -> bool:
        return self.done and self.finish_reason == "length" and self.error is None


def test_a_replica_killed_mid_stream_fails_only_its_own_clients_and_rejoins_after_a_restart(tmp_path):
    assert ROUTER.exists(), "vllm-router is a test dependency (pip install -e '.[test]')"
    ports = [free_port(), free_port()]
    router_port = free_port()
    survivor_port, victim_port = ports
    processes: list[Process] = []
    try:
        processes += [start_replica(port, tmp_path) for port in ports]
        router = start_router(router_port, ports, tmp_path)
        processes.append(router)
        url = f"http://127.0.0.1:{router_port}/v1/completions"
        survivor_before = finished_requests(survivor_port)

        streams = [Stream(url) for _ in range(NUM_STREAMS)]
        _wait(lambda: all(stream.num_text_chunks >= 5 for stream in streams), router, "every stream to flow", 60)
        victim = processes[1]
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait(timeout=10)
        for stream in streams:
            stream.thread.join(STREAM_TIMEOUT_S)
            assert not stream.thread.is_alive(), "a stream hung after its replica died"

        completed = [stream for stream in streams if stream.completed]
        failed = [stream for stream in streams if not stream.completed]
        # Round-robin put streams on both replicas: the survivor's finished whole, the victim's ended in an error.
        assert len(completed) == finished_requests(survivor_port) - survivor_before
        assert completed and failed, [(stream.num_text_chunks, stream.done, stream.error) for stream in streams]
        for stream in failed:
            assert stream.error is not None and not stream.done, vars(stream)
            assert stream.num_text_chunks < STREAM_TOKENS
        print(f"{len(completed)} streams finished, {len(failed)} ended in: {sorted({s.error for s in failed})}")

        # Within a health-check period the router stops choosing the dead replica: every request is answered.
        time.sleep(3 * HEALTH_CHECK_INTERVAL_S)
        before = finished_requests(survivor_port)
        body = {"model": MODEL, "prompt": "In the beginning", "max_tokens": 4}
        statuses = [httpx.post(url, json=body, timeout=30).status_code for _ in range(8)]
        assert statuses == [200] * 8
        assert finished_requests(survivor_port) - before == 8

        # A restart on the same port rejoins: the router sends it requests again once its health check passes.
        processes[1] = start_replica(victim_port, tmp_path)
        deadline = time.monotonic() + 60
        while finished_requests(victim_port) == 0:
            assert time.monotonic() < deadline, f"the restarted replica got no request:\n{router.log()[-3000:]}"
            assert httpx.post(url, json=body, timeout=30).status_code == 200
            time.sleep(0.2)
    finally:
        for process in processes:
            process.kill()
