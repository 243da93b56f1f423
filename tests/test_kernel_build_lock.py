"""Building the C++ CPU kernels never blocks a start: a lock left by a killed build is cleared, a live builder is
waited for within a bound, and a folder that cannot be written is replaced by one that can.

Each case runs `load_cpu_kernels()` in a subprocess with a time limit (a hang fails the test instead of stalling
the suite), against a build folder the test sets up.
"""

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.kernels import cpu_extension
from kvserve.kernels.cpu_extension import extension_name, load_cpu_kernels

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="no C++ compiler to build the CPU kernels")

LOAD = (
    "import logging, sys\n"
    "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
    "from kvserve.kernels.cpu_extension import load_cpu_kernels\n"
    "print('loaded' if load_cpu_kernels() else 'torch path')\n"
)
COLD_BUILD_LIMIT_S = 180  # a cold build takes 10-20 s on 2 cores; a busy machine, several times that


def load_in_subprocess(env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LOAD], env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s
    )


def test_a_lock_left_by_a_killed_build_does_not_stop_the_next_load():
    """The suite's own build folder, with the 0-byte `lock` torch's builder leaves when it is killed."""
    build_dir = cpu_extension._build_directory()
    stale = build_dir / "lock"
    stale.touch()
    result = load_in_subprocess({}, timeout_s=120)
    assert result.stdout.strip() == "loaded", result.stderr
    assert "left by a build that did not finish" in result.stderr
    assert not stale.exists()


def test_a_live_builder_is_waited_for_within_a_bound():
    build_dir = cpu_extension._build_directory()
    with open(build_dir / "kvserve.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        start_s = time.monotonic()
        result = load_in_subprocess({"KVSERVE_KERNEL_BUILD_WAIT_S": "1"}, timeout_s=60)
        elapsed_s = time.monotonic() - start_s
    assert result.stdout.strip() == "torch path", result.stderr
    assert "waiting up to 1 s for another process building" in result.stderr
    assert "held the build lock" in result.stderr
    assert elapsed_s < 30


@pytest.mark.slow  # a cold build of the C++ kernels
def test_a_build_killed_midway_is_followed_by_a_normal_one(tmp_path):
    """The issue's case: the first start is killed while it compiles (Ctrl-C, OOM kill, a rolled-back deploy); the
    next start builds and loads within a normal build's time."""
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    build_dir = tmp_path / "extensions" / extension_name()
    first = subprocess.Popen([sys.executable, "-c", LOAD], env={**os.environ, **env}, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (build_dir / "lock").exists():  # torch's builder holds its lock: the compile is under way
            assert first.poll() is None and time.monotonic() < deadline, "the first build never started"
            time.sleep(0.05)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the compiler and ninja too
        first.wait(timeout=30)
    assert (build_dir / "lock").exists()

    start_s = time.monotonic()
    result = load_in_subprocess(env, timeout_s=COLD_BUILD_LIMIT_S)
    assert result.stdout.strip() == "loaded", result.stderr
    assert "left by a build that did not finish" in result.stderr
    assert (build_dir / f"{build_dir.name}.so").exists()
    print(f"build after a killed one: {time.monotonic() - start_s:.1f} s")


@pytest.mark.slow  # a cold build of the C++ kernels
def test_a_folder_that_cannot_be_written_falls_back_to_the_temporary_directory(tmp_path):
    """TORCH_EXTENSIONS_DIR below a regular file cannot be created, even by root (as a read-only home cannot be
    written by its user): the build goes to the temporary directory, and says so."""
    (tmp_path / "a-file").write_text("")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {"TMPDIR": str(temporary), "TORCH_EXTENSIONS_DIR": str(tmp_path / "a-file" / "below")}
    result = load_in_subprocess(env, timeout_s=COLD_BUILD_LIMIT_S)
    assert result.stdout.strip() == "loaded", result.stderr
    assert "cannot build the C++ CPU kernels in" in result.stderr
    fallback = temporary / f"kvserve-torch-extensions-{os.getuid()}" / extension_name()
    assert f"building the C++ CPU kernels in {fallback} instead" in result.stderr
    assert (fallback / f"{fallback.name}.so").exists()


def test_a_home_that_cannot_be_written_falls_back_to_the_temporary_directory(tmp_path):
    """No TORCH_EXTENSIONS_DIR: torch's default root lies under $HOME, here below a regular file. The folder chosen
    is the temporary directory's (the build there is the test above's)."""
    (tmp_path / "a-file").write_text("")
    env = {**os.environ, "TMPDIR": str(tmp_path), "HOME": str(tmp_path / "a-file" / "home")}
    env.pop("TORCH_EXTENSIONS_DIR", None)
    code = "from kvserve.kernels.cpu_extension import _build_directory\nprint(_build_directory())\n"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    expected = tmp_path / f"kvserve-torch-extensions-{os.getuid()}" / extension_name()
    assert result.stdout.strip() == str(expected)
    assert f"cannot build the C++ CPU kernels in {tmp_path / 'a-file' / 'home'}" in result.stderr


def test_the_build_name_changes_with_the_sources(tmp_path, monkeypatch):
    """Two checkouts with different sources build into two folders instead of rebuilding over each other."""
    changed = tmp_path / "cpu_layer_ops.cpp"
    changed.write_text(Path(cpu_extension.SOURCES[1]).read_text() + "\n// changed\n")
    before = extension_name()
    monkeypatch.setattr(cpu_extension, "SOURCES", [cpu_extension.SOURCES[0], changed])
    assert extension_name() != before
    assert extension_name().split("_")[2] == before.split("_")[2]  # the same CPU


@pytest.mark.slow  # a cold build of the C++ kernels
def test_a_full_disk_under_the_build_folder_ends_in_the_torch_path(tmp_path):
    """The build folder on a 256 KiB tmpfs: the compiler's output does not fit, the build fails saying so, and the
    engine takes the torch path (it serves; slower) instead of hanging or crashing."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True,
                             text=True)  # fmt: skip
    if mounted.returncode != 0:  # a container without CAP_SYS_ADMIN
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        result = load_in_subprocess({"TORCH_EXTENSIONS_DIR": str(disk)}, timeout_s=COLD_BUILD_LIMIT_S)
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)
    assert result.stdout.strip() == "torch path", result.stderr
    assert "No space left on device" in result.stderr
    assert "C++ CPU kernels unavailable, using the torch attention path" in result.stderr


@pytest.mark.parametrize(("value", "expected"), [("", 300.0), ("2.5", 2.5), ("-1", 0.0), ("abc", 300.0)])
def test_the_build_wait_setting_is_read_leniently(monkeypatch, value, expected):
    """A bad KVSERVE_KERNEL_BUILD_WAIT_S is logged and the default used: it must not stop a start."""
    monkeypatch.setenv("KVSERVE_KERNEL_BUILD_WAIT_S", value)
    assert cpu_extension._wait_limit_s() == expected
