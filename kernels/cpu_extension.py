"""Builds and loads kvserve's C++ CPU kernels (`kernels/csrc/`) with torch's own extension tooling.

The library is compiled for the machine's own instruction set (`-march=native`) the first time a
process asks for it (a few seconds), into torch's extensions directory (`TORCH_EXTENSIONS_DIR`,
default `~/.cache/torch_extensions`), under a name that includes this CPU's feature flags so a
shared cache never hands one CPU another's build; later starts load it in well under a second.
It registers `torch.ops.kvserve_cpu.*`. Without a C++ compiler or ninja it is not built, and the
engine runs the torch path instead.
"""

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("cpu_paged_attention.cpp", "cpu_layer_ops.cpp")]
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp"]


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (or find in the cache) and load the library; False, with the reason logged, if it cannot be."""
    from torch.utils.cpp_extension import load  # needs setuptools and a compiler only when called

    start_s = time.monotonic()
    _put_ninja_on_path()
    try:
        load(name=f"kvserve_cpu_{_cpu_tag()}", sources=[str(path) for path in SOURCES],
             extra_cflags=COMPILE_FLAGS, is_python_module=False)  # fmt: skip
    except (RuntimeError, OSError, ImportError) as error:
        logger.warning("C++ CPU kernels unavailable, using the torch attention path: %s", error)
        return False
    logger.info("C++ CPU kernels loaded in %.1f s", time.monotonic() - start_s)
    return True


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the ninja package sits in the venv's bin, not on PATH unless it is activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags (empty where /proc/cpuinfo is missing)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return hashlib.sha256(flags.encode()).hexdigest()[:12]
