"""Security properties: the API key is compared in constant time, CORS is off unless configured, a checkpoint can
neither run pickle nor its own code, and a bad model path stops the CLI with one line, not a traceback.

Request size limits (body, prompt list, stop strings, n, logprobs, headers) and error messages that name no
server file are checked case by case in tests/test_server_errors.py and tests/test_server_faults.py.
"""

import hmac
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvserve.engine import EngineConfig, LLMEngine
from kvserve.engine.model_loader import CheckpointError
from tests.server_harness import TINY_MODEL, assert_openai_error, tiny_server

API_KEY = "sekret-key"
COMPLETION = {"model": TINY_MODEL, "prompt": "Hi", "max_tokens": 1}
ALLOWED_ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": "https://elsewhere.example", "Access-Control-Request-Method": "POST"}


class TouchWhenUnpickled:
    """Unpickling this creates `marker`: proof that a loader ran pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def copy_checkpoint(tiny_checkpoints, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoints["qwen2"], tmp_path / "checkpoint"))


def test_the_api_key_is_compared_with_hmac_compare_digest(tiny_checkpoints, monkeypatch):
    compared = []
    real_compare = hmac.compare_digest

    def recording_compare(given, expected):
        compared.append((given, expected))
        return real_compare(given, expected)

    monkeypatch.setattr(hmac, "compare_digest", recording_compare)
    with tiny_server(tiny_checkpoints, api_key=API_KEY) as running, httpx.Client(base_url=running.base_url) as client:
        assert_openai_error(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200

    assert compared == [(b"wrong", API_KEY.encode()), (API_KEY.encode(), API_KEY.encode())]


def test_cors_is_off_by_default(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        preflight = client.options("/v1/completions", headers=PREFLIGHT)
        simple = client.get("/v1/models", headers={"Origin": PREFLIGHT["Origin"]})

    assert "access-control-allow-origin" not in preflight.headers
    assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers


def test_cors_allows_only_the_configured_origins(tiny_checkpoints):
    with (
        tiny_server(tiny_checkpoints, cors_allow_origins=[ALLOWED_ORIGIN]) as running,
        httpx.Client(base_url=running.base_url, timeout=30) as client,
    ):
        allowed = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": ALLOWED_ORIGIN})
        other = client.options("/v1/completions", headers=PREFLIGHT)

    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "access-control-allow-origin" not in other.headers


def test_a_checkpoint_with_only_pickle_weights_is_refused_without_unpickling_them(tiny_checkpoints, tmp_path):
    model_dir = copy_checkpoint(tiny_checkpoints, tmp_path)
    (model_dir / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (model_dir / "pytorch_model.bin").write_bytes(pickle.dumps(TouchWhenUnpickled(marker)))

    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin not loaded: kvserve reads safetensors only"):
        LLMEngine(EngineConfig(model=str(model_dir), device="cpu"))
    assert not marker.exists()


def test_a_checkpoint_that_asks_for_its_own_code_is_refused_without_running_it(tiny_checkpoints, tmp_path):
    model_dir = copy_checkpoint(tiny_checkpoints, tmp_path)
    marker = tmp_path / "ran"
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig"}
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "configuration_custom.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")

    with pytest.raises(CheckpointError, match="auto_map"):
        LLMEngine(EngineConfig(model=str(model_dir), device="cpu"))
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["missing directory", "directory without config.json", "pickle-only checkpoint"])
def test_kvserve_serve_refuses_a_bad_model_path_with_one_line_and_no_traceback(tiny_checkpoints, tmp_path, kind):
    model_dir = tmp_path / "model"
    if kind != "missing directory":
        model_dir.mkdir()
    if kind == "pickle-only checkpoint":
        model_dir = copy_checkpoint(tiny_checkpoints, tmp_path)
        (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    command = [sys.executable, "-P", "-m", "kvserve.server.cli", "serve", str(model_dir), "--port", "0"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(model_dir) in errors[0], result.stderr
    assert "Traceback" not in result.stderr
