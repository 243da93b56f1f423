"""How busy the machine and our processes were, from /proc and getrusage: benchmarks report it beside their
figures (these 2-core machines are shared). No third-party imports, so GPU machines can run it too."""

import os
import resource
from pathlib import Path


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
