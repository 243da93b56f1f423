"""The engine runs where only torch, triton and transformers are installed (as on the GPU machine):
nothing below `server/` imports the HTTP or metrics packages."""

import subprocess
import sys

SERVER_ONLY_PACKAGES = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client", "openai")


def import_without_server_packages(modules: str) -> subprocess.CompletedProcess:
    # A None entry in sys.modules makes importing that package raise ImportError.
    code = f"import sys\nfor name in {SERVER_ONLY_PACKAGES!r}:\n    sys.modules[name] = None\nimport {modules}\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_engine_and_kernels_import_without_server_packages():
    result = import_without_server_packages("engine, engine.llm, kernels, kernels.triton_backend, scheduler, kvcache")
    assert result.returncode == 0, result.stderr


def test_the_server_does_need_them():
    result = import_without_server_packages("server.app")
    assert result.returncode != 0
    assert "halted; None in sys.modules" in result.stderr
