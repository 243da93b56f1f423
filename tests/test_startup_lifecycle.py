"""`kvserve serve`'s start-up under faults, as a subprocess on loopback: it binds its port first and answers 503
"starting: <phase>" while it builds the engine; a stuck phase ends with --startup-timeout-s (status 1, naming the
phase); a taken port (status 1) and a broken checkpoint (status 2, one `error:` line) end promptly with a message
naming the cause, not a traceback.

The stuck phase is made real: the test holds the C++ kernels' build lock (kernels/cpu_extension.py), so the server
waits on it as it would on another process building them.
"""

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvserve.kernels import cpu_extension
from kvserve.kernels.cpu_extension import extension_name, load_cpu_kernels
from tests.test_server_process import (
    ServerProcess,
    _wait_until_healthy,
    assert_all_gone,
    descendants,
    free_port,
    process_env,
    serve_command,
    serve_process,
)

EXIT_LIMIT_S = 60  # a start that is refused ends well within this


def start(model_dir: Path, tmp_path: Path, port: int, *flags: str, **env: str) -> subprocess.Popen:
    log = (tmp_path / f"server-{port}.log").open("w")
    return subprocess.Popen(serve_command(model_dir, "--port", str(port), *flags), env=process_env(tmp_path, **env),
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


def as_server(process: subprocess.Popen, tmp_path: Path, port: int) -> ServerProcess:
    return ServerProcess(process, f"http://127.0.0.1:{port}", tmp_path / f"server-{port}.log")


def log_of(tmp_path: Path, port: int) -> str:
    return (tmp_path / f"server-{port}.log").read_text()


def first_health(base_url: str, process: subprocess.Popen, deadline_s: float = 60) -> httpx.Response:
    """The first answer of /health: the port is bound before the engine is built."""
    deadline = time.monotonic() + deadline_s
    while True:
        assert process.poll() is None, "the server exited while starting"
        assert time.monotonic() < deadline, "the port was never bound"
        try:
            return httpx.get(base_url + "/health", timeout=2)
        except httpx.TransportError:
            time.sleep(0.05)


@pytest.fixture
def held_kernel_build_lock():
    """The build lock of the C++ kernels, held as a process building them would hold it."""
    if not load_cpu_kernels():
        pytest.skip("no C++ compiler to build the CPU kernels")
    with open(cpu_extension._build_directory() / "kvserve.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield held


def test_health_names_the_phase_while_starting_and_requests_get_503(tiny_checkpoints, tmp_path, held_kernel_build_lock):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    process = start(tiny_checkpoints["llama"], tmp_path, port, KVSERVE_KERNEL_BUILD_WAIT_S="120")
    try:
        health = first_health(base_url, process)
        while health.json()["status"] != "starting: loading the kernels":  # earlier phases pass quickly
            assert health.status_code == 503 and health.json()["status"].startswith("starting: "), health.text
            health = httpx.get(base_url + "/health", timeout=2)
        assert health.status_code == 503
        completion = httpx.post(base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert completion.status_code == 503
        assert completion.json()["error"]["message"] == "the server is starting: loading the kernels"
        assert httpx.get(base_url + "/metrics", timeout=5).status_code == 200

        fcntl.flock(held_kernel_build_lock, fcntl.LOCK_UN)  # the other "builder" finished
        _wait_until_healthy(as_server(process, tmp_path, port), timeout_s=60)
        completion = httpx.post(base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert completion.status_code == 200, completion.text
    finally:
        process.kill()
        process.wait(timeout=10)
    log = log_of(tmp_path, port)
    for line in ("start-up: loading weights done in", "start-up: loading the kernels done in", "start-up: ready in"):
        assert line in log, log


def test_a_stuck_start_ends_at_the_startup_timeout_naming_the_phase(tiny_checkpoints, tmp_path, held_kernel_build_lock):
    port = free_port()
    start_s = time.monotonic()
    process = start(tiny_checkpoints["llama"], tmp_path, port, "--startup-timeout", "3",
                    KVSERVE_KERNEL_BUILD_WAIT_S="120")  # fmt: skip
    assert process.wait(timeout=EXIT_LIMIT_S) == 1
    assert time.monotonic() - start_s < EXIT_LIMIT_S
    log = log_of(tmp_path, port)
    assert "start-up did not finish within 3 s: stuck loading the kernels" in log, log
    assert "Traceback" not in log


def test_a_port_already_taken_is_an_exit_with_a_message(tiny_checkpoints, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = start(tiny_checkpoints["llama"], tmp_path, port)
        status = process.wait(timeout=EXIT_LIMIT_S)
    log = log_of(tmp_path, port)
    assert status != 0
    assert "address already in use" in log.lower(), log
    assert "Traceback" not in log, log


@pytest.mark.parametrize("damage", ["truncated", "missing shard"])
def test_a_broken_checkpoint_is_refused_naming_the_file(tiny_checkpoints, tmp_path, damage):
    """The Llama checkpoint has two shards: one cut short (as a copy still being written), or one gone."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama"], model_dir)
    shard = sorted(model_dir.glob("*.safetensors"))[-1]
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        shard.unlink()
    port = free_port()
    process = start(model_dir, tmp_path, port)
    assert process.wait(timeout=EXIT_LIMIT_S) == 2  # a checkpoint kvserve cannot load, as a bad model path
    log = log_of(tmp_path, port)
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and shard.name in errors[0], log
    assert "Traceback" not in log, log


def test_a_normal_start_logs_each_phase_with_its_time(tiny_checkpoints, tmp_path):
    with serve_process(tiny_checkpoints["qwen3"], tmp_path) as server:
        assert httpx.get(server.base_url + "/health", timeout=5).json() == {"status": "ok"}
        log = server.log()
    for phase in ("checking the checkpoint and loading its tokenizer", "loading weights", "loading the kernels",
                  "sizing the KV cache"):  # fmt: skip
        assert f"start-up: {phase} done in" in log, log


def test_sigterm_while_starting_exits_promptly_and_leaves_nothing(tiny_checkpoints, tmp_path, held_kernel_build_lock):
    port = free_port()
    process = start(tiny_checkpoints["llama"], tmp_path, port, KVSERVE_KERNEL_BUILD_WAIT_S="120")
    health = first_health(f"http://127.0.0.1:{port}", process)
    while health.json()["status"] != "starting: loading the kernels":
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    children = descendants(process.pid)
    start_s = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=EXIT_LIMIT_S) == 0
    assert time.monotonic() - start_s < 10, log_of(tmp_path, port)
    assert_all_gone(children)
    assert not (cpu_extension._build_directory() / "lock").exists()  # it never started torch's build


@pytest.mark.slow  # a cold build of the C++ kernels
def test_two_servers_started_at_once_on_a_cold_cache_build_the_kernels_once(tiny_checkpoints, tmp_path):
    if not load_cpu_kernels():
        pytest.skip("no C++ compiler to build the CPU kernels")
    cold = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    ports = [free_port(), free_port()]
    processes = [start(tiny_checkpoints["llama"], tmp_path, port, **cold) for port in ports]
    try:
        for port, process in zip(ports, processes, strict=True):
            # A cold build on 2 busy cores, then the other's load.
            _wait_until_healthy(as_server(process, tmp_path, port), timeout_s=240)
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=10)
    logs = [log_of(tmp_path, port) for port in ports]
    assert sum("C++ CPU kernels built and loaded in" in log for log in logs) == 1, logs  # one built them
    assert sum("waiting up to" in log and "C++ CPU kernels loaded in" in log for log in logs) == 1, logs


@pytest.mark.slow  # eight start-ups
@pytest.mark.parametrize(
    "phase", ["checking the checkpoint and loading its tokenizer", "loading weights", "loading the kernels",
              "sizing the KV cache"],
)  # fmt: skip
def test_a_start_killed_in_any_phase_is_followed_by_a_normal_one(tiny_checkpoints, tmp_path, phase):
    """SIGKILL as soon as the phase's first log line is out (the process gets no chance to clean up), then a normal
    start: healthy, and serving."""
    port = free_port()
    process = start(tiny_checkpoints["llama"], tmp_path, port)
    deadline = time.monotonic() + EXIT_LIMIT_S
    while f"start-up: {phase} ..." not in log_of(tmp_path, port):
        assert process.poll() is None and time.monotonic() < deadline, log_of(tmp_path, port)
        time.sleep(0.01)
    process.kill()
    process.wait(timeout=10)
    with serve_process(tiny_checkpoints["llama"], tmp_path) as server:
        completion = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert completion.status_code == 200, completion.text


@pytest.mark.slow  # a cold build of the C++ kernels
def test_sigterm_while_the_kernels_compile_stops_the_compiler_too(tiny_checkpoints, tmp_path):
    """A first start on a cold cache, stopped while torch's builder runs ninja and the compiler: the server exits
    promptly with no process of the build left running; the next start builds and serves."""
    if not load_cpu_kernels():
        pytest.skip("no C++ compiler to build the CPU kernels")
    cold = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    build_dir = tmp_path / "extensions" / extension_name()
    port = free_port()
    process = start(tiny_checkpoints["llama"], tmp_path, port, **cold)
    deadline = time.monotonic() + EXIT_LIMIT_S
    while not (descendants(process.pid) and (build_dir / "lock").exists()):  # the compiler is running
        assert process.poll() is None and time.monotonic() < deadline, log_of(tmp_path, port)
        time.sleep(0.05)
    children = descendants(process.pid)
    start_s = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=EXIT_LIMIT_S) == 0
    assert time.monotonic() - start_s < 10, log_of(tmp_path, port)
    assert_all_gone(children, within_s=10)  # SIGTERM reached them as the server left: a moment to go
    with serve_process(tiny_checkpoints["llama"], tmp_path, **cold) as server:
        completion = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert completion.status_code == 200, completion.text


def test_a_tensor_parallel_rank_killed_while_loading_ends_the_start_naming_it(tiny_checkpoints, tmp_path):
    """Rank 1 is SIGKILLed as soon as it starts loading its shard: rank 0's start-up fails at the next collective
    (gloo sees the peer gone) and the server exits with status 1, no rank left behind."""
    port = free_port()
    process = start(tiny_checkpoints["llama"], tmp_path, port, "--tensor-parallel-size", "2")
    deadline = time.monotonic() + EXIT_LIMIT_S
    while "rank 1: start-up: loading weights ..." not in log_of(tmp_path, port):
        assert process.poll() is None and time.monotonic() < deadline, log_of(tmp_path, port)
        time.sleep(0.01)
    ranks = {pid for pid in descendants(process.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()}
    assert len(ranks) == 1, ranks
    os.kill(ranks.pop(), signal.SIGKILL)
    children = descendants(process.pid)
    assert process.wait(timeout=EXIT_LIMIT_S) == 1, log_of(tmp_path, port)
    log = log_of(tmp_path, port)
    assert "start-up failed" in log and "rank 1" in log.split("start-up failed", 1)[1], log
    # multiprocessing's resource tracker ignores SIGTERM and leaves once the server's end of its pipe closes.
    assert_all_gone(children, within_s=10)


def test_a_model_folder_changed_under_a_running_server_changes_nothing_it_serves(tiny_checkpoints, tmp_path):
    """Everything is read at start-up: weights deleted, config and tokenizer files overwritten (a deploy copying a
    new checkpoint over the old one) leave the answers and /health as they were."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama"], model_dir)
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with serve_process(model_dir, tmp_path) as server:
        before = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30).json()
        for path in model_dir.glob("*.safetensors"):
            path.unlink()
        for path in model_dir.glob("*.json"):
            path.write_text("{not json")
        after = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30).json()
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
