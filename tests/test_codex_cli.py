"""The Codex CLI (`@openai/codex` from npm) with kvserve as a custom Responses provider: one non-interactive `exec`
turn against a tiny checkpoint whose chat template shows tools. Codex sends what it sends every turn (its own
instructions, function tools, `reasoning.summary`, `include`, `client_metadata`, `store: false`, a stream) and must
end the turn with the model's answer and the usage the server counted.

Codex is installed once into ~/.cache/kvserve (npm, pinned); without npm on the PATH the test is skipped.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvserve.testing.tiny_checkpoint import write_random_checkpoint
from tests.conftest import TINY_CONFIGS
from tests.server_harness import TINY_MODEL, assert_nothing_allocated, tiny_server

CODEX_VERSION = "0.171.0"
CODEX_DIR = Path.home() / ".cache" / "kvserve" / f"codex-{CODEX_VERSION}"
TURN_TIMEOUT_S = 240
CONFIG = """
model = "{model}"
model_provider = "kvserve"
# Built-in web search and sub-agent tools are OpenAI-hosted kinds a local model cannot serve (kvserve refuses them by
# name); Codex's function tools (exec_command, ...) stay.
web_search = "disabled"

[agents]
enabled = false

[features]
goals = false

[model_providers.kvserve]
name = "kvserve"
base_url = "{base_url}/v1"
wire_api = "responses"
"""


@pytest.fixture(scope="module")
def codex() -> Path:
    binary = CODEX_DIR / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed: the Codex CLI comes from npm")
        subprocess.run(["npm", "install", "--prefix", str(CODEX_DIR), "--no-audit", "--no-fund",
                        f"@openai/codex@{CODEX_VERSION}"], check=True, capture_output=True, timeout=300)  # fmt: skip
    return binary


@pytest.fixture(scope="module")
def live(tokenizer, tmp_path_factory):
    config = TINY_CONFIGS["llama"](len(tokenizer))
    # Codex's instructions and tool definitions are ~27k characters, which this tokenizer spells out in ~16k tokens.
    config.max_position_embeddings = 32768
    model = write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp("codex") / "llama", seed=7)
    with tiny_server({"llama": model}, tool_call_parser="hermes", kv_cache_memory_bytes=64 << 20) as running:
        yield running
        running.wait_until_idle()
        assert_nothing_allocated(running)


def test_codex_exec_runs_one_turn_against_kvserve(codex, live, tmp_path):
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(CONFIG.format(model=TINY_MODEL, base_url=live.base_url))
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {**os.environ, "CODEX_HOME": str(home), "NO_COLOR": "1"}
    env.pop("OPENAI_API_KEY", None)
    prompt_tokens_before = live.metric("prompt_tokens_total") or 0.0
    generated_before = live.metric("generation_tokens_total") or 0.0
    finished = subprocess.run(
        [str(codex), "exec", "--json", "--skip-git-repo-check", "--sandbox", "read-only", "Say hello."],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=TURN_TIMEOUT_S,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    events = [json.loads(line) for line in finished.stdout.splitlines() if line.startswith("{")]
    kinds = [event["type"] for event in events]
    assert "turn.failed" not in kinds and "error" not in kinds, events
    assert kinds[-1] == "turn.completed"
    items = [event["item"] for event in events if event["type"] == "item.completed"]
    answers = [item for item in items if item["type"] == "agent_message"]
    assert len(answers) == 1 and answers[0]["text"].strip(), items
    # The usage Codex reports is the server's own count of that turn's tokens.
    usage = events[-1]["usage"]
    assert usage["input_tokens"] == (live.metric("prompt_tokens_total") or 0.0) - prompt_tokens_before > 10_000
    assert usage["output_tokens"] == (live.metric("generation_tokens_total") or 0.0) - generated_before > 0
