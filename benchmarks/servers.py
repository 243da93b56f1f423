"""Starting a server process for a benchmark: a free loopback port, waiting until it is healthy, stopping it.
(The CPU time a process and the machine used is in benchmarks/cpu_usage.py.)"""

import socket
import subprocess
import time

import httpx

STARTUP_TIMEOUT_S = 900  # a server's first start may build a checkpoint or kernels


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
