"""`kvserve serve` as a real process on a loopback port: draining on SIGTERM, stopping at once, stopping when the
engine keeps failing, and settings from a YAML file, KVSERVE_* variables and flags. Every process is bounded by
timeouts and killed at the end, with anything it started."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server_harness import assert_openai_error

MODEL = "tiny-llama"
COMPLETIONS = "/v1/completions"
KV_CACHE_BYTES = 8 << 20
STARTUP_TIMEOUT_S = 90
EXIT_TIMEOUT_S = 30
SHORT = {"prompt": "Once upon a time", "max_tokens": 2}
# Four sequences of 500 tokens: seconds of work on a CPU, so it is still running when SIGTERM comes.
LONG = {"prompt": "Hi", "max_tokens": 500, "n": 4, "ignore_eos": True}
SUBMIT_WAIT_S = 0.5  # after the long request left the client: ample for a loopback server to queue it
# The drain test's request takes seconds alone but minutes on a CPU shared with another test run; the drain
# timeout must outlast it, and the process exits as soon as it is done anyway.
DRAIN_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 300


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout_s: float = 10.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while (match := re.search(pattern, self.log())) is None:
            assert time.monotonic() < deadline, f"no {pattern!r} in the log:\n{self.log()}"
            time.sleep(0.05)
        return match

    def wait_for_exit(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {timeout_s} s:\n{self.log()}")


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def assert_all_gone(pids: set[int], within_s: float = 0.0) -> None:
    """None of `pids` is still running (a zombie waiting for its parent counts as gone), now or, given `within_s`,
    within that many seconds (a process that exits once its parent's pipe closes takes a moment)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = set()
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.add(pid)
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    assert not alive, "processes left behind:\n" + "\n".join(_describe(pid) for pid in sorted(alive))


def _describe(pid: int) -> str:
    """A process left behind, for the failure message: its state, parent and command line, and which other
    processes hold the pipes it has open (what keeps a process that waits for its pipe to close alive)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid}: gone while described"
    pipes = {link for link in _fd_links(pid) if link.startswith("pipe:")}
    holders = sorted(
        (other, link) for other in map(int, filter(str.isdigit, os.listdir("/proc"))) if other != pid
        for link in _fd_links(other) if link in pipes
    )  # fmt: skip
    return f"{pid}: state {fields[0]}, parent {fields[1]}: {command[:200]}; its pipes also held by {holders}"


def _fd_links(pid: int) -> list[str]:
    links = []
    with contextlib.suppress(OSError):
        for fd in list(Path(f"/proc/{pid}/fd").iterdir()):
            with contextlib.suppress(OSError):  # closed while we looked
                links.append(os.readlink(fd))
    return links


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The console script pip installs, as a user runs it (from a directory of their own: see `serve_process`).
KVSERVE = str(Path(sys.executable).with_name("kvserve"))


def serve_command(model_dir: Path, *flags: str) -> list[str]:
    return [KVSERVE, "serve", str(model_dir), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *flags]


def assert_answers_within_a_json_schema(server: "ServerProcess", model: str) -> None:
    """A chat request through the openai client, constrained by a strict JSON schema, answers JSON that fits it."""
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A number?"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert isinstance(json.loads(constrained.choices[0].message.content)["n"], int)


def refusal_of(model_dir: Path, tmp_path: Path) -> str:
    """The one `error: ` line `kvserve serve` exits with (status 2) for a checkpoint it refuses at start-up."""
    command = serve_command(model_dir, "--port", str(free_port()))
    done = subprocess.run(command, env=process_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(errors) == 1, output
    return errors[0]


def process_env(tmp_path: Path, **variables: str) -> dict[str, str]:
    """This process's environment without its KVSERVE_* settings, plus `variables` and a private cache dir."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVSERVE_")}
    return {**env, "KVSERVE_CACHE_DIR": str(tmp_path / "cache"), **variables}


@contextmanager
def serve_process(model_dir: Path, tmp_path: Path, *flags: str, **env: str) -> Iterator[ServerProcess]:
    """`kvserve serve` on a free port, once its /health answers 200; killed on the way out if still running."""
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            serve_command(model_dir, "--port", str(port), *flags), env=process_env(tmp_path, **env), cwd=tmp_path,
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path)
    try:
        _wait_until_healthy(server)
        yield server
    finally:
        left = descendants(process.pid) if process.poll() is None else set()
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        for pid in left:  # a test that failed midway must not leave workers hogging the CPU for the next ones
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _wait_until_healthy(server: ServerProcess, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert server.process.poll() is None, f"the server exited while starting:\n{server.log()}"
        assert time.monotonic() < deadline, f"no healthy server after {timeout_s} s:\n{server.log()}"
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)


class BackgroundRequest:
    """A POST sent from a thread: its response (or transport error) and when it came back."""

    def __init__(self, url: str, body: dict) -> None:
        self.sent = threading.Event()
        self.response: httpx.Response | None = None
        self.error: httpx.TransportError | None = None
        self.done_s: float | None = None
        self._thread = threading.Thread(target=self._post, args=(url, body), daemon=True)
        self._thread.start()
        assert self.sent.wait(10), "the request was never sent"
        time.sleep(SUBMIT_WAIT_S)

    def _post(self, url: str, body: dict) -> None:
        hooks = {"request": [lambda request: self.sent.set()]}
        try:
            with httpx.Client(timeout=REQUEST_TIMEOUT_S, event_hooks=hooks) as client:
                self.response = client.post(url, json=body)
        except httpx.TransportError as error:
            self.error = error
        self.done_s = time.monotonic()

    def join(self, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the request did not come back"


# Stopping


def test_sigterm_drains_refusing_new_requests_while_the_one_in_flight_completes(tiny_checkpoints, tmp_path):
    # One sequence at a time keeps the request in flight long after the signal, on any CPU.
    flags = ("--drain-timeout-s", str(DRAIN_TIMEOUT_S), "--served-model-name", MODEL, "--max-num-seqs", "1")
    with serve_process(tiny_checkpoints["llama"], tmp_path, *flags) as server:
        in_flight = BackgroundRequest(server.base_url + COMPLETIONS, LONG)
        children = descendants(server.process.pid)
        server.process.send_signal(signal.SIGTERM)

        draining = server.wait_for_log(r"draining: (\d+) requests in flight")
        # One engine request per choice; the first choice may already be done, as they run one at a time.
        assert 1 <= int(draining[1]) <= LONG["n"]
        refused = httpx.post(server.base_url + COMPLETIONS, json=SHORT, timeout=30)
        refused_s = time.monotonic()
        assert_openai_error(refused, 503)
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 503
        assert httpx.get(server.base_url + "/metrics", timeout=30).status_code == 200  # scrapers see the drain

        in_flight.join()
        assert in_flight.error is None and in_flight.response.status_code == 200, in_flight.response.text
        choices = in_flight.response.json()["choices"]
        assert [choice["finish_reason"] for choice in choices] == ["length"] * LONG["n"]
        assert in_flight.response.json()["usage"]["completion_tokens"] == LONG["n"] * LONG["max_tokens"]
        assert refused_s < in_flight.done_s  # the 503 came while the long request was still running
        assert server.wait_for_exit(EXIT_TIMEOUT_S) == 0
        assert_all_gone(children)


def test_when_the_drain_timeout_ends_the_requests_still_running_get_503_and_the_process_exits(
    tiny_checkpoints, tmp_path
):
    # One sequence at a time: the 16 choices take far longer than the drain timeout.
    drain_timeout_s = 2.0
    flags = ("--drain-timeout-s", str(drain_timeout_s), "--max-num-seqs", "1")
    with serve_process(tiny_checkpoints["llama"], tmp_path, *flags) as server:
        in_flight = BackgroundRequest(server.base_url + COMPLETIONS, {**LONG, "n": 16})
        children = descendants(server.process.pid)
        signalled_s = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        assert server.wait_for_exit(EXIT_TIMEOUT_S) == 0
        exit_s = time.monotonic() - signalled_s
        in_flight.join()
        assert in_flight.error is None, in_flight.error
        assert "shut down" in assert_openai_error(in_flight.response, 503)["message"]
        print(f"drain timeout {drain_timeout_s} s: exited {exit_s:.2f} s after SIGTERM")
        # The timeout, then one engine step, uvicorn's 0.1 s for open connections and the interpreter's exit
        # (about 1 s in all on an idle machine; the margin is for a busy one).
        assert drain_timeout_s <= exit_s < drain_timeout_s + 5
        assert_all_gone(children)


def test_with_no_drain_timeout_sigterm_stops_at_once_without_waiting_for_requests(tiny_checkpoints, tmp_path):
    # One sequence at a time: the 16 choices take far longer than the 5 s this test allows.
    flags = ("--drain-timeout-s", "0", "--max-num-seqs", "1")
    with serve_process(tiny_checkpoints["llama"], tmp_path, *flags) as server:
        in_flight = BackgroundRequest(server.base_url + COMPLETIONS, {**LONG, "n": 16})
        children = descendants(server.process.pid)
        signalled_s = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        assert server.wait_for_exit(5) == 0
        assert_all_gone(children)
        print(f"drain timeout 0: exited {time.monotonic() - signalled_s:.2f} s after SIGTERM")
        assert time.monotonic() - signalled_s < 5
        in_flight.join()
        assert in_flight.done_s - signalled_s < 5
        assert in_flight.error is None, in_flight.error
        assert "shut down" in assert_openai_error(in_flight.response, 503)["message"]
        assert "draining" not in server.log()


def test_an_engine_whose_steps_keep_failing_stops_the_process_with_status_1(tiny_checkpoints, tmp_path):
    flags = ("--served-model-name", MODEL, "--max-consecutive-step-failures", "2")
    fault = {"KVSERVE_FAULT_INJECTION": "raise:0"}  # every model step raises (testing/fault_injection.py)
    with serve_process(tiny_checkpoints["llama"], tmp_path, *flags, **fault) as server:
        children = descendants(server.process.pid)
        for _ in range(2):
            error = assert_openai_error(httpx.post(server.base_url + COMPLETIONS, json=SHORT, timeout=30), 500)
            assert "/" not in error["message"] and "injected" not in error["message"]

        assert server.wait_for_exit(EXIT_TIMEOUT_S) == 1
        assert_all_gone(children)
        log = server.log()
        assert "TEST ONLY" in log and "2 model steps failed in a row" in log and "exiting with status 1" in log


# Settings


def test_flags_override_env_variables_which_override_the_yaml_file(tiny_checkpoints, tmp_path):
    config = tmp_path / "kvserve.yaml"
    config.write_text("served_model_name: from-yaml\nmax_n: 2\nmax_stop_strings: 2\n")
    env = {"KVSERVE_SERVED_MODEL_NAME": "from-env", "KVSERVE_MAX_N": "3"}
    flags = ("--config", str(config), "--served-model-name", "from-flag")
    with (
        serve_process(tiny_checkpoints["llama"], tmp_path, *flags, **env) as server,
        httpx.Client(base_url=server.base_url, timeout=30) as client,
    ):
        assert [card["id"] for card in client.get("/v1/models").json()["data"]] == ["from-flag"]  # flag > env > YAML
        too_many_choices = client.post(COMPLETIONS, json={**SHORT, "n": 4})
        assert "[1, 3]" in assert_openai_error(too_many_choices, 400, param="n")["message"]  # env > YAML
        too_many_stops = client.post(COMPLETIONS, json={**SHORT, "stop": ["a", "b", "c"]})
        assert "at most 2" in assert_openai_error(too_many_stops, 400, param="stop")["message"]  # YAML > default
        assert client.post(COMPLETIONS, json={**SHORT, "model": "from-flag", "n": 3}).status_code == 200


@pytest.mark.parametrize(
    ("config_text", "env", "named"),
    [
        ("served_model_name: x\nmax_batch_size: 8\n", {}, "max_batch_size"),
        ("served_model_name: x\n", {"KVSERVE_MAX_N": "lots"}, "max_n"),
    ],
    ids=["unknown key in the YAML file", "wrongly typed env variable"],
)
def test_a_bad_setting_stops_the_process_with_a_message_naming_it(tiny_checkpoints, tmp_path, config_text, env, named):
    config = tmp_path / "kvserve.yaml"
    config.write_text(config_text)
    command = serve_command(tiny_checkpoints["llama"], "--config", str(config), "--port", str(free_port()))
    result = subprocess.run(
        command, env=process_env(tmp_path, **env), cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert re.search(rf"\b{named}\b", result.stderr), result.stderr
