"""Benchmarks' child processes: how they start (`child_cwd`: where `python -m benchmarks.<name>` finds this package
and nothing else of the repository) and what they and the machine use, from /proc and getrusage: benchmarks report
it beside their figures (these 2-core machines are shared). Standard library only: GPU machines and vLLM's venv
import it too."""

import functools
import os
import resource
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@functools.cache
def child_cwd() -> Path:
    """The working directory of the benchmarks' children: a folder holding only a link to this package. From the
    repository's root, its folders (`kernels`, ...) would shadow other distributions' packages of those names for
    a `python -m` child: transformers imports Hugging Face's `kernels` where it is installed, as in vLLM's venv."""
    folder = Path(tempfile.mkdtemp(prefix="kvserve-bench-"))
    (folder / "benchmarks").symlink_to(REPO / "benchmarks", target_is_directory=True)
    return folder


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a child, with the tokenizers library's thread pool off."""
    return dict(os.environ, TOKENIZERS_PARALLELISM="false", **overrides)


def command_line(module: str) -> str:
    """The command that ran benchmark `module` (its `__spec__.name`) with this process's arguments, to print
    beside its figures: the interpreter relative to the working directory when it lies below it."""
    python = os.path.relpath(sys.executable) if Path(sys.executable).is_relative_to(Path.cwd()) else sys.executable
    return shlex.join([python, "-m", module, *sys.argv[1:]])


# ---- CPU ----


def machine_busy_s() -> float:
    """CPU seconds all processes have run (user, nice, system, irq, softirq) since boot, from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended (and been waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu_s(pid: int) -> float:
    """CPU seconds a running process (all its threads) has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class OthersLoad:
    """The cores other processes kept busy from this object's creation to `measure()`: all the CPU time the machine
    ran, less what this process's children that ended meanwhile and the running `our_pids` (a server) used."""

    def __init__(self, *our_pids: int) -> None:
        self.our_pids = our_pids
        self.start_s, self.machine_s, self.ours_s = time.perf_counter(), machine_busy_s(), self._ours_s()

    def measure(self) -> tuple[float, float]:
        """(wall seconds since the start, cores other processes kept busy meanwhile)."""
        wall_s = time.perf_counter() - self.start_s
        others_s = machine_busy_s() - self.machine_s - (self._ours_s() - self.ours_s)
        return wall_s, max(others_s, 0.0) / wall_s

    def _ours_s(self) -> float:
        return children_cpu_s() + sum(process_cpu_s(pid) for pid in self.our_pids)


# ---- memory ----


class TreeRSS:
    """Peak resident memory of a process and all its descendants, sampled every 0.2 s from /proc."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_bytes, self._done = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak_bytes

    def _sample(self) -> None:
        while not self._done.wait(0.2):
            self.peak_bytes = max(self.peak_bytes, sum(_rss_bytes(pid) for pid in _descendants(self.pid)))


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def _rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0
