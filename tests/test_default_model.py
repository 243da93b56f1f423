"""The built-in default model is made deterministically on first use and runs from the command line."""

import filecmp
import os
import subprocess
import sys

from engine.default_model import DEFAULT_MODEL_NAME, default_model_dir

CHECKPOINT_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]


def test_default_model_is_built_identically_in_two_caches(tmp_path, monkeypatch):
    built = []
    for name in ("first", "second"):
        monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / name))
        built.append(default_model_dir())
    assert built[0] == tmp_path / "first" / DEFAULT_MODEL_NAME
    _, mismatch, errors = filecmp.cmpfiles(built[0], built[1], CHECKPOINT_FILES, shallow=False)
    assert (mismatch, errors) == ([], [])
    assert not [p.name for p in (tmp_path / "first").iterdir() if p.name != DEFAULT_MODEL_NAME]  # no staging left


def test_kvserve_generate_runs_on_the_default_model_and_says_its_weights_are_random(tmp_path):
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "generate", "--prompt", "Once upon a time", "--max-tokens", "8"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "RANDOM" in result.stderr
    assert "1 requests, 8 tokens in" in result.stdout
    assert "tokens/s" in result.stdout
