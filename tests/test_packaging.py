"""The built wheel carries what kvserve needs at run time: every module of its packages (the package list in
pyproject.toml is explicit, so a new sub-package left off it would be missing from installed copies only), the
console's static files, the default model's checkpoint and its draft's, and the C++ kernels' sources (built on first
use)."""

import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

from kvserve.engine.default_model import default_draft_dir, default_model_dir
from kvserve.server.console import STATIC_DIR

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("server", "engine", "scheduler", "kvcache", "kernels", "testing")


def test_the_built_wheel_carries_the_console_the_default_model_and_the_kernel_sources(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(REPO_ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("kvserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = [f"kvserve/server/console/static/{path.name}" for path in STATIC_DIR.iterdir()]
    expected += [f"kvserve/engine/assets/default_model/{path.name}" for path in default_model_dir().iterdir()]
    expected += [f"kvserve/engine/assets/default_draft/{path.name}" for path in default_draft_dir().iterdir()]
    expected += [f"kvserve/kernels/csrc/{path.name}" for path in (REPO_ROOT / "kernels" / "csrc").iterdir()]
    assert [name for name in expected if name not in names] == []
    modules = [path.relative_to(REPO_ROOT) for folder in PACKAGE_FOLDERS for path in (REPO_ROOT / folder).rglob("*.py")]
    assert len(modules) > 50
    assert [str(module) for module in modules if f"kvserve/{module.as_posix()}" not in names] == []
    # Nothing but kvserve's own namespace at the top of site-packages.
    assert {name.split("/")[0] for name in names} == {"kvserve", f"kvserve-{version('kvserve')}.dist-info"}
