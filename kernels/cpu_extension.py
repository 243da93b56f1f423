"""Builds and loads kvserve's C++ CPU kernels (`kernels/csrc/`) with torch's own extension tooling.

The library is compiled for the machine's own instruction set (`-march=native`) the first time a
process asks for it (10-20 s on 2 cores), into torch's extensions directory (`TORCH_EXTENSIONS_DIR`,
default `~/.cache/torch_extensions/<python>_cpu`), under a name that holds this CPU's feature flags and
a digest of the sources, flags and torch version: a shared cache never hands one CPU another's build,
and two checkouts never rebuild over each other. Later starts load it in well under a second. It
registers `torch.ops.kvserve_cpu.*`. Without a C++ compiler or ninja it is not built, and the engine
runs the torch path instead.

Start-up never waits on a dead builder: torch guards a build with a `lock` file that a killed build
leaves behind, and every later start would wait on it forever. kvserve takes an OS file lock first
(`flock`, released by the kernel when its holder dies, however it dies); whoever holds it is the only
builder of that folder, so a torch `lock` found then is stale and removed. Waiting on a live builder
is bounded (`KVSERVE_KERNEL_BUILD_WAIT_S`, default 300 s), and then ends in the torch path, as does a
folder that cannot be written, after trying one under the system's temporary directory.
"""

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in ("cpu_paged_attention.cpp", "cpu_layer_ops.cpp", "cpu_block_quant.cpp")
]
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp"]
BUILD_WAIT_S = 300.0  # a cold build takes 10-20 s on 2 cores
LOCK_POLL_S = 0.2


class KernelBuildUnavailable(RuntimeError):
    """The kernels cannot be built or loaded here; the message says why."""


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (or find in the cache) and load the library; False, with the reason logged, if it cannot be."""
    start_s = time.monotonic()
    try:
        build_dir = _build_directory()
        with _build_lock(build_dir, _wait_limit_s()):
            built = _is_built(build_dir)
            if not built:
                logger.info("building the C++ CPU kernels in %s (once per machine, about 10-20 s)", build_dir)
            _load(build_dir)
    except (KernelBuildUnavailable, RuntimeError, OSError, ImportError) as error:
        logger.warning("C++ CPU kernels unavailable, using the torch attention path: %s", error)
        return False
    logger.info("C++ CPU kernels %s in %.1f s", "loaded" if built else "built and loaded", time.monotonic() - start_s)
    return True


def extension_name() -> str:
    """`kvserve_cpu_<CPU flags digest>_<build digest>`: one build per CPU kind and per version of the sources."""
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.read_bytes())
    digest.update(" ".join([*COMPILE_FLAGS, torch.__version__, sys.version]).encode())
    return f"kvserve_cpu_{_cpu_tag()}_{digest.hexdigest()[:12]}"


def _build_directory() -> Path:
    """The extension's folder under torch's extensions root, or under the temporary directory where that root
    cannot be written (a read-only home, as hardened containers have)."""
    roots = [_torch_extensions_root(), Path(tempfile.gettempdir()) / f"kvserve-torch-extensions-{os.getuid()}"]
    for root in roots:
        folder = root / extension_name()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".writable-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as error:
            logger.warning("cannot build the C++ CPU kernels in %s (%s)", folder, error.strerror or error)
            continue
        if root != roots[0]:
            logger.warning("building the C++ CPU kernels in %s instead", folder)
        return folder
    raise KernelBuildUnavailable("no writable folder to build them in (set TORCH_EXTENSIONS_DIR to one)")


def _torch_extensions_root() -> Path:
    """Where torch puts extensions: `TORCH_EXTENSIONS_DIR`, or its default root with a Python and CPU folder."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


def _wait_limit_s() -> float:
    value = os.environ.get("KVSERVE_KERNEL_BUILD_WAIT_S")
    if not value:
        return BUILD_WAIT_S
    try:
        return max(0.0, float(value))
    except ValueError:
        logger.warning("KVSERVE_KERNEL_BUILD_WAIT_S=%r is not a number of seconds; waiting %.0f s", value, BUILD_WAIT_S)
        return BUILD_WAIT_S


@contextmanager
def _build_lock(build_dir: Path, wait_s: float):
    """Hold the folder's OS file lock (waiting at most `wait_s` for a live holder); inside it, no other kvserve
    process builds there, so torch's own `lock` file, if any, was left by a dead build and is removed."""
    with open(build_dir / "kvserve.lock", "a") as lock_file:
        deadline = time.monotonic() + wait_s
        logged = False
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not logged:
                    logger.info("waiting up to %.0f s for another process building the C++ CPU kernels in %s",
                                wait_s, build_dir)  # fmt: skip
                    logged = True
                if time.monotonic() >= deadline:
                    raise KernelBuildUnavailable(
                        f"another process has held the build lock of {build_dir} for over {wait_s:.0f} s"
                    ) from None
                time.sleep(LOCK_POLL_S)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _is_built(build_dir: Path) -> bool:
    return (build_dir / f"{build_dir.name}.so").exists()


def _load(build_dir: Path) -> None:
    from torch.utils.cpp_extension import load  # needs setuptools and a compiler only when called

    _put_ninja_on_path()
    load(name=build_dir.name, sources=[str(path) for path in SOURCES], extra_cflags=COMPILE_FLAGS,
         build_directory=str(build_dir), is_python_module=False)  # fmt: skip


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
