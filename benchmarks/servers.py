"""Starting a `kvserve serve` process for a benchmark: its command, a free loopback port, waiting until it is healthy,
stopping it."""

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 900  # a server's first start may build a checkpoint or kernels
SERVED_MODEL_NAME = "bench"  # what the benchmarks' servers call their checkpoint, and their clients send as `model`


def kvserve_serve_command(model_dir: Path | str | None, port: int, *flags: str) -> list[str]:
    """`kvserve serve` on `port` by this interpreter (`model_dir` None: the built-in default model). `-P` keeps the
    working directory, the repository root, off the import path: the server imports kvserve as installed."""
    model = [str(model_dir)] if model_dir else []
    return [sys.executable, "-P", "-m", "kvserve.server.cli", "serve", *model, "--port", str(port), *flags]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(base_url: str, process: subprocess.Popen) -> None:
    """Return once GET /health answers 200; raise if the process exits or the time runs out first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become healthy")


def stop(process: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def serving(process: subprocess.Popen, base_url: str) -> Iterator[None]:
    """Wait until the server `process` is healthy at `base_url`; stop it on the way out, also when that fails."""
    try:
        wait_healthy(base_url, process)
        yield
    finally:
        stop(process)
