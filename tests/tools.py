"""External programs some tests run (Prometheus, promtool): found on PATH, or the test fails.

A missing tool fails the test rather than skipping it, so CI cannot pass without having run it.
Set KVSERVE_ALLOW_MISSING_TOOLS=1 to skip such tests instead, on a machine without them.
"""

import os
import shutil

import pytest

ALLOW_MISSING_ENV = "KVSERVE_ALLOW_MISSING_TOOLS"


def require_tool(name: str, install_hint: str) -> str:
    """The tool's path; fails (or, with KVSERVE_ALLOW_MISSING_TOOLS=1, skips) the test if it is missing."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} is not on PATH ({install_hint})"
    if os.environ.get(ALLOW_MISSING_ENV) == "1":
        pytest.skip(message)
    pytest.fail(f"{message}; set {ALLOW_MISSING_ENV}=1 to skip the tests that need it", pytrace=False)
