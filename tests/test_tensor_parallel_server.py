"""`kvserve serve --tensor-parallel-size 2` on the CPU (gloo): served answers equal the unsplit engine's through the
openai client, the metrics and /health report the ranks, and what happens when ranks stop: SIGTERM leaves no
process behind, a killed or hung rank ends the server with status 1 naming it (bounded by the collective
timeout), a bad split is refused at start-up, and ranks launched from outside (torchrun-style variables) meet
and serve the same tokens."""

import os
import signal
import subprocess
import time

import httpx
import pytest
from openai import OpenAI

from kvserve.engine import LLM, SamplingParams
from tests.server_harness import TINY_MODEL, assert_nothing_allocated, tiny_server
from tests.test_server_process import (
    COMPLETIONS,
    EXIT_TIMEOUT_S,
    LONG,
    BackgroundRequest,
    ServerProcess,
    _wait_until_healthy,
    assert_all_gone,
    descendants,
    free_port,
    process_env,
    serve_command,
    serve_process,
)  # fmt: skip

PROMPTS = ["Once upon a time there was", "The cache is cut into blocks", "What is a token?"]
MAX_TOKENS = 16
HANG_TIMEOUT_S = 8  # the collective timeout the hung-rank test sets


@pytest.fixture(scope="module")
def unsplit_outputs(tiny_checkpoints):
    with LLM(str(tiny_checkpoints["llama"])) as llm:
        return llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0, ignore_eos=True))


def _assert_same_as_unsplit(client: OpenAI, unsplit_outputs) -> None:
    for prompt, expected in zip(PROMPTS, unsplit_outputs, strict=True):
        answer = client.completions.create(model=TINY_MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=0, extra_body={"ignore_eos": True})  # fmt: skip
        choice = answer.choices[0]
        assert choice.text == expected.text
        assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)


def test_a_split_server_answers_as_the_unsplit_engine_and_reports_its_ranks(tiny_checkpoints, unsplit_outputs):
    with tiny_server(tiny_checkpoints, tensor_parallel_size=2) as running:
        client = OpenAI(base_url=f"{running.base_url}/v1", api_key="unused")
        _assert_same_as_unsplit(client, unsplit_outputs)
        stream = client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, stream=True, temperature=0)  # fmt: skip
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert running.metric("tensor_parallel_size") == 2
        assert httpx.get(f"{running.base_url}/health").status_code == 200
        assert running.engine.core.kv_cache.spec.num_kv_heads == 1  # each rank: one of the two KV heads
        assert_nothing_allocated(running)


def test_an_abort_storm_on_a_split_server_frees_every_block_and_leaves_the_ranks_in_step(
    tiny_checkpoints, unsplit_outputs, monkeypatch
):
    import asyncio

    from tests.test_server_load import (
        ABORT_STORM_REQUESTS,
        PREFILL_CHUNK_TOKENS,
        STORM_MAX_NUM_SEQS,
        StormReport,
        abort_storm,
    )  # fmt: skip

    settings = {"max_num_seqs": STORM_MAX_NUM_SEQS, "max_prefill_chunk_tokens": PREFILL_CHUNK_TOKENS}
    with tiny_server(tiny_checkpoints, tensor_parallel_size=2, **settings) as running:
        report = StormReport()
        asyncio.run(abort_storm(running.base_url, ABORT_STORM_REQUESTS, seed=1, report=report))
        running.wait_until_idle(timeout_s=60)
        assert report.unexpected == [] and report.completed == report.client_behaviours["complete"]
        assert_nothing_allocated(running)
        # Every rank's cache is still where rank 0 thinks it is: the next answers are the unsplit engine's.
        _assert_same_as_unsplit(OpenAI(base_url=f"{running.base_url}/v1", api_key="unused"), unsplit_outputs)


def _worker_pids(server: ServerProcess) -> set[int]:
    """The spawned ranks (multiprocessing's resource tracker aside)."""
    return {pid for pid in descendants(server.process.pid) if b"spawn_main" in _cmdline(pid)}


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read()
    except OSError:
        return b""


def _assert_gone_soon(pids: set[int], timeout_s: float = 10.0) -> None:
    """Every one of `pids` exits within `timeout_s` (multiprocessing's resource tracker leaves just after rank 0)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_cmdline(pid) for pid in pids):
        time.sleep(0.1)
    assert_all_gone(pids)


FLAGS = ("--served-model-name", TINY_MODEL, "--tensor-parallel-size", "2")


def test_ranks_wait_out_idle_time_longer_than_the_timeout_and_sigterm_stops_them_all(tiny_checkpoints, tmp_path):
    flags = (*FLAGS, "--tensor-parallel-timeout-s", str(HANG_TIMEOUT_S))
    with serve_process(tiny_checkpoints["llama"], tmp_path, *flags) as server:
        children = descendants(server.process.pid)
        assert len(_worker_pids(server)) == 1
        time.sleep(HANG_TIMEOUT_S + 2)  # idle: the worker's wait for the next step has no timeout
        response = httpx.post(server.base_url + COMPLETIONS, json={"model": TINY_MODEL, "prompt": "Hi"}, timeout=60)
        assert response.status_code == 200
        server.process.send_signal(signal.SIGTERM)
        assert server.wait_for_exit(EXIT_TIMEOUT_S) == 0
        _assert_gone_soon(children)


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_rank_that_dies_or_hangs_ends_the_server_with_status_1_naming_it(tiny_checkpoints, tmp_path, fault):
    flags = (*FLAGS, "--tensor-parallel-timeout-s", str(HANG_TIMEOUT_S))
    with serve_process(tiny_checkpoints["llama"], tmp_path, *flags) as server:
        children = descendants(server.process.pid)
        (worker,) = _worker_pids(server)
        request = BackgroundRequest(server.base_url + COMPLETIONS, {**LONG, "model": TINY_MODEL})
        os.kill(worker, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        started_s = time.monotonic()
        assert server.wait_for_exit(HANG_TIMEOUT_S + EXIT_TIMEOUT_S) == 1
        print(f"\n{fault} rank: the server exited {time.monotonic() - started_s:.1f} s later")
        request.join()
        assert request.error is not None or request.response.status_code >= 500
        _assert_gone_soon(children)
        log = server.log()
        named = "tensor-parallel rank 1" if fault == "killed" else "a tensor-parallel step failed"
        assert named in log and "exiting with status 1" in log, log


def test_a_step_stuck_outside_every_collective_ends_the_server_through_the_watchdog(tiny_checkpoints, tmp_path):
    """Rank 0 blocks inside a step where no collective timeout reaches it (an injected hang before the step's plan
    is sent): after two timeouts without a collective the watchdog logs every thread's stack, the request in flight
    gets a 503 naming it (not a cancelled task's 500), and the server exits with status 1 without waiting on the
    stuck thread."""
    timeout_s = 3
    flags = (*FLAGS, "--tensor-parallel-timeout-s", str(timeout_s))
    fault = {"KVSERVE_FAULT_INJECTION": "hang:0"}  # the first model step blocks (testing/fault_injection.py)
    with serve_process(tiny_checkpoints["llama"], tmp_path, *flags, **fault) as server:
        children = descendants(server.process.pid)
        request = BackgroundRequest(server.base_url + COMPLETIONS, {**LONG, "model": TINY_MODEL})
        assert server.wait_for_exit(2 * timeout_s + EXIT_TIMEOUT_S) == 1
        request.join()
        assert request.response is not None and request.response.status_code == 503, request.error
        assert "a tensor-parallel step failed" in request.response.json()["error"]["message"]
        _assert_gone_soon(children)
        log = server.log()
        assert "a tensor-parallel step failed: no collective finished for" in log, log
        assert "exiting with status 1" in log, log
        assert "every thread's stack follows" in log and "fault_injection.py" in log, log  # where it was stuck


def test_a_split_that_does_not_divide_the_model_is_refused_at_start_up(tiny_checkpoints, tmp_path):
    command = serve_command(tiny_checkpoints["llama"], "--tensor-parallel-size", "3", "--port", str(free_port()))
    done = subprocess.run(command, env=process_env(tmp_path), cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "tensor_parallel_size 3 does not divide 8 attention heads" in done.stderr


def test_ranks_launched_from_outside_meet_on_master_addr_and_serve(tiny_checkpoints, tmp_path, unsplit_outputs):
    port, master_port = free_port(), free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "WORLD_SIZE": "2"}
    model_dir = tiny_checkpoints["llama"]
    command = serve_command(model_dir, *FLAGS, "--port", str(port))
    logs = [tmp_path / f"rank-{rank}.log" for rank in range(2)]
    processes = []
    for rank, log in enumerate(logs):
        env_of_rank = process_env(tmp_path, RANK=str(rank), **env)
        with log.open("w") as output:
            processes.append(subprocess.Popen(command, env=env_of_rank, cwd=tmp_path, stdout=output, stderr=output))
    try:
        rank_0 = ServerProcess(processes[0], f"http://127.0.0.1:{port}", logs[0])
        _wait_until_healthy(rank_0)
        _assert_same_as_unsplit(OpenAI(base_url=f"{rank_0.base_url}/v1", api_key="unused"), unsplit_outputs)
        assert "rank 1: running the worker loop" in logs[1].read_text()
        processes[0].send_signal(signal.SIGTERM)
        assert processes[0].wait(timeout=EXIT_TIMEOUT_S) == 0
        assert processes[1].wait(timeout=EXIT_TIMEOUT_S) == 0  # rank 0 told it to stop
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
